"""In-loop evaluation on the training group: mean CE over the held-out `*.val.jsonl` documents."""

import logging
import math
from dataclasses import dataclass

import torch

from apps.main.transformer import batch_doc_ids
from lingua.args import require
from lingua.collectives import agree_count, dist_mean_dict
from lingua.eval_data import iterate_eval_batches
from lingua.kd_loss import cross_entropy_sum

logger = logging.getLogger(__name__)

EVAL_UNEVEN = ("min", "error")


@dataclass
class EvalArgs:
    every: int = 0  # steps between in-loop evaluations (0 = never)
    max_batches: int = 16  # per rank
    # Ranks holding different numbers of eval batches (agreed before the loop either way):
    # "min" = every rank runs the smallest count, with a warning naming them; "error" = stop, naming them.
    uneven: str = "min"

    def validate(self) -> None:
        require(self.every >= 0, "eval.every", self.every, "use a number of steps, or 0 to turn in-loop evaluation off")
        require(self.max_batches >= 1, "eval.max_batches", self.max_batches, "use a positive number of batches per rank")
        require(self.uneven in EVAL_UNEVEN, "eval.uneven", self.uneven, f"use one of {', '.join(EVAL_UNEVEN)}")


class Evaluator:
    """Owns its cadence (`should_run`) and runs the eval over this rank's share of the held-out files."""

    def __init__(self, args: EvalArgs, data_args, attn_mask: str, tokenizer, topo):
        self.args, self.data_args, self.attn_mask = args, data_args, attn_mask
        self.tokenizer, self.topo = tokenizer, topo

    def should_run(self, step: int) -> bool:
        return bool(self.args.every) and step % self.args.every == 0

    @torch.no_grad()
    def run(self, model, step: int) -> dict:
        """The eval row of `step`; ranks first agree on how many batches to run (a CountMismatch otherwise)."""
        topo = self.topo
        batches = list(iterate_eval_batches(self.data_args, self.tokenizer, topo.dp_rank, topo.dp_degree,
                                            self.args.max_batches))
        n_batches = agree_count(len(batches), topo.train_group, topo.device, "eval batches",
                                mode="min" if self.args.uneven == "min" else "equal")
        loss_sum = tokens = 0.0
        model.eval()
        for batch in batches[:n_batches]:
            labels = batch["labels"].to(topo.device)
            logits = model(batch["input_ids"].to(topo.device), doc_ids=batch_doc_ids(self.attn_mask, batch, topo.device))
            loss_sum += cross_entropy_sum(logits, labels).item()
            tokens += int((labels != -100).sum())
        model.train()
        totals = dist_mean_dict(dict(loss_sum=loss_sum, tokens=tokens), topo.train_group, topo.device)
        eval_loss = totals["loss_sum"] / max(totals["tokens"], 1)
        logger.info(f"eval step {step}: loss {eval_loss:.4f} over {n_batches} batches per rank")
        return {"step": step, "eval/loss": eval_loss, "eval/ppl": math.exp(min(eval_loss, 50))}
