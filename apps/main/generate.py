"""Sample text from a student: our DCP checkpoint or an exported Hugging Face directory.

    python -m apps.main.generate ckpt=dumps/run/checkpoints prompt="def main(" max_new_tokens=50 \
        temperature=0.8 top_p=0.95

`ckpt` is a checkpoint step directory, a checkpoints root (latest step), or a directory written by
apps.main.export_hf (detected by its config.json). The prompt starts with BOS only when training
documents did (`data.add_bos` of the run's config). No KV cache: each new token reruns the prompt, which
is plenty for eyeballing small students.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from apps.main.export_hf import (
    TRAINING_PARAMS,
    load_model_state_dict,
    load_params,
    model_args_from_params,
    resolve_checkpoint_dir,
    trained_with_bos,
)
from apps.main.transformer import LMTransformer
from lingua.args import dataclass_from_dict, parse_args
from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError, MissingPathError
from lingua.tokenizer import Tokenizer, TokenizerArgs, build_tokenizer

logger = logging.getLogger(__name__)

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # input_ids [1, S] -> logits [1, S, V]


class LoadedStudent(NamedTuple):
    logits_fn: LogitsFn
    tokenizer: Tokenizer
    max_seqlen: Optional[int]
    add_bos: bool  # the run's data.add_bos: a prompt starts the way its training documents did


@dataclass
class GenerateArgs:
    ckpt: str = ""  # checkpoint step dir, checkpoints root, or exported HF dir
    prompt: str = ""  # the text to continue (the tokenizer's bos is added where it has one)
    max_new_tokens: int = 50  # tokens to generate after the prompt (fewer where eos comes first)
    temperature: float = 0.8  # sampling temperature (lower: more likely tokens); 0 = greedy
    top_p: float = 0.95  # nucleus sampling; 1.0 keeps the whole distribution
    seed: int = 42  # the sampling's random seed (same seed, same text)
    device: str = "auto"  # "auto" (cuda if available) | "cpu" | "cuda" | "cuda:1" ...


def sample_next_token(logits: torch.Tensor, temperature: float, top_p: float,
                      generator: Optional[torch.Generator] = None) -> int:
    """One token id from logits [V]: greedy at temperature 0, else temperature + nucleus (top-p) sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(descending=True)
    # Drop a token once the mass before it already reaches top_p; the most likely token always stays.
    outside_nucleus = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside_nucleus, 0.0)
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(sorted_ids[choice])


@torch.inference_mode()
def generate_tokens(logits_fn: LogitsFn, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
                    top_p: float = 0.95, max_seqlen: Optional[int] = None, eos_id: Optional[int] = None,
                    device: torch.device = torch.device("cpu"), generator: Optional[torch.Generator] = None) -> list[int]:
    """The new token ids (prompt excluded); stops early at `eos_id`. Context beyond max_seqlen is cut from the left."""
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens; pass a non-empty prompt or a tokenizer that adds bos.")
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = ids[-max_seqlen:] if max_seqlen else ids
        logits = logits_fn(torch.tensor([context], dtype=torch.long, device=device))[0, -1]
        next_id = sample_next_token(logits, temperature, top_p, generator)
        ids.append(next_id)
        if eos_id is not None and next_id == eos_id:
            break
    return ids[len(prompt_ids):]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_student(ckpt: str, device: torch.device) -> LoadedStudent:
    """The model's logits function, tokenizer, context length and BOS rule, from a DCP checkpoint or an
    exported HF directory (a directory without our training_params.json: BOS whenever the tokenizer has one)."""
    path = Path(ckpt)
    if (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise MissingPathError(f"'{path}' holds no Hugging Face tokenizer (exported before exports "
                                   f"carried one); export the checkpoint again, or generate from its directory.")
        tokenizer = build_tokenizer(TokenizerArgs(name="hf", path=str(path)))
        params_file = path / TRAINING_PARAMS
        add_bos = trained_with_bos(json.loads(params_file.read_text())) if params_file.is_file() else True
        return LoadedStudent(lambda ids: model(ids).logits, tokenizer, model.config.max_position_embeddings, add_bos)
    ckpt_dir = resolve_checkpoint_dir(ckpt)
    params = load_params(ckpt_dir)
    model = load_checkpoint_model(ckpt_dir, params, device)
    tokenizer = build_tokenizer(dataclass_from_dict(TokenizerArgs, params.get("data", {}).get("tokenizer", {})))
    return LoadedStudent(model, tokenizer, model_args_from_params(params).max_seqlen, trained_with_bos(params))


def load_checkpoint_model(ckpt_dir: Path, params: dict, device: torch.device) -> LMTransformer:
    """Our LMTransformer with the weights of a DCP checkpoint step directory, in eval mode on `device`."""
    model_args = model_args_from_params(params)
    with torch.device("meta"):
        model = LMTransformer(model_args)
    model.to_empty(device=device)
    model.init_weights()  # RoPE tables and the embedding tie; weights are overwritten just below
    state_dict = load_model_state_dict(ckpt_dir)
    if model_args.tie_embeddings:
        state_dict.setdefault("output.weight", state_dict.get("tok_embeddings.weight"))
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as err:
        raise DataError(f"the weights in {ckpt_dir} do not fit the model described by its params.json: {err}") from None
    logger.info(f"loaded {ckpt_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    return model.eval()


def generate_text(args: GenerateArgs) -> str:
    """The prompt's continuation as text."""
    if not args.ckpt:
        raise ConfigError("pass ckpt=<checkpoint directory or exported HF directory>.")
    device = pick_device(args.device)
    student = load_student(args.ckpt, device)
    tokenizer = student.tokenizer
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed)
    prompt_ids = tokenizer.encode(args.prompt, add_bos=student.add_bos, add_eos=False)
    new_ids = generate_tokens(student.logits_fn, prompt_ids, args.max_new_tokens, args.temperature, args.top_p,
                              student.max_seqlen, tokenizer.eos_id, device, generator)
    if tokenizer.eos_id is not None and new_ids and new_ids[-1] == tokenizer.eos_id:
        new_ids = new_ids[:-1]
    return tokenizer.decode(new_ids)


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(GenerateArgs, argv)
    print(args.prompt + generate_text(args))


if __name__ == "__main__":
    run_cli(main)
