"""Whether a launch's config fits the run already in its dump dir, read from the newest checkpoint's params.json.

    refuse_another_model(args)   every rank, after the config check and before anything is written: a dump dir
                                 holding another model's run is one sentence, and the launch changes no file there
    restore_run(args, topo, model, optimizer)
                                 the checkpoint manager and the state to resume from; then the run's config.yaml
    schedule_notice(args, step)   after a resume: one line when `steps` changed, since the lr schedule stretches

Only what decides whether the weights can be loaded refuses a launch: the parameter shapes and the vocabulary. The
run's name is named beside them (it tells the user whose run it is) but alone refuses nothing; any other setting may
change between launches of one run.
"""

import json
import logging
from pathlib import Path
from typing import Optional

from lingua.args import dump_config
from lingua.checkpoint import PARAMS, CheckpointManager, complete_checkpoints
from lingua.errors import LaunchError
from lingua.run.dump_dir import RunDir

logger = logging.getLogger(__name__)

SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of", "tie_embeddings")


def checkpoint_root(args) -> Path:
    return Path(args.checkpoint.path) if args.checkpoint.path else RunDir(args.dump_dir).checkpoints


def restore_checkpoint(args, topo, model, optimizer) -> tuple[CheckpointManager, Optional[dict]]:
    """The checkpoint manager (training group) and the train state to resume from, if any (a fresh run may start from
    init_ckpt_path: weights, or all with continue_training_from_init)."""
    checkpoint = CheckpointManager(args.checkpoint, str(checkpoint_root(args)), topo.train_group, topo.train_rank,
                                   topo.train_world_size)
    saved = checkpoint.load(model, optimizer)
    return checkpoint, saved if saved is not None else checkpoint.load_init(model, optimizer)


def restore_run(args, topo, model, optimizer) -> tuple[CheckpointManager, Optional[dict]]:
    """`restore_checkpoint`, then the resolved config into the dump dir (defaults filled, vocab from the tokenizer;
    mesh -1s stay: a relaunch may resize): after every check, so a refused launch leaves the old one."""
    checkpoint, saved = restore_checkpoint(args, topo, model, optimizer)
    if topo.is_train_master:
        dump_config(args, RunDir(args.dump_dir).config)
    return checkpoint, saved


def saved_run(args) -> Optional[tuple[Path, dict]]:
    """The newest complete checkpoint a launch would resume from and the config it saved, or None (none there, or
    its params.json cannot be read: the checkpoint load names that damage in its own sentence)."""
    found = complete_checkpoints(checkpoint_root(args))
    if not found:
        return None
    try:
        return found[-1], json.loads((found[-1] / PARAMS).read_text())
    except (OSError, ValueError):
        return None


def _shape(model: dict, key: str):
    return model.get("n_kv_heads") or model.get("n_heads") if key == "n_kv_heads" else model.get(key)


def _tokenizer_words(tokenizer: dict) -> str:
    return tokenizer.get("name", "?") + (f" {tokenizer['path']}" if tokenizer.get("path") else "")


def vocabulary_difference(saved: dict, args) -> Optional[str]:
    """How the vocabulary of the saved run differs from this config's, or None when they are the same size."""
    from lingua.args import to_dict

    saved_vocab = saved.get("model", {}).get("vocab_size")
    saved_tokenizer = saved.get("data", {}).get("tokenizer", {})
    tokenizer = to_dict(args.data.tokenizer)
    vocab = args.model.vocab_size
    if vocab == -1:  # taken from the tokenizer: the same tokenizer settings give the same vocabulary
        if all(saved_tokenizer.get(k) == tokenizer.get(k) for k in ("name", "path")):
            return None
        from lingua.tokenizer import build_tokenizer

        try:
            vocab = build_tokenizer(args.data.tokenizer).n_words
        except Exception:  # unreadable here: the trainer's own tokenizer step says why, after this check
            return None
    if saved_vocab in (None, vocab):
        return None
    return (f"a vocabulary of {saved_vocab:,} tokens (tokenizer {_tokenizer_words(saved_tokenizer)}) there, "
            f"{vocab:,} (tokenizer {_tokenizer_words(tokenizer)}) here")


def refuse_another_model(args) -> None:
    """Raise `LaunchError` when the dump dir's newest checkpoint holds a model this config cannot resume: it names
    the checkpoint, the settings that differ and the run's name, and says to pick another dump_dir. Reads files
    only, so every rank decides alike, and before this launch writes anything into the dump dir."""
    found = saved_run(args)
    if found is None:
        return
    ckpt, saved = found
    saved_model = saved.get("model", {})
    model = {key: getattr(args.model, key) for key in SHAPE_KEYS}
    differences = [f"model.{key}={_shape(saved_model, key)} there, {_shape(model, key)} here" for key in SHAPE_KEYS
                   if key in saved_model and _shape(saved_model, key) != _shape(model, key)]
    vocabulary = vocabulary_difference(saved, args)
    differences += [vocabulary] if vocabulary else []
    if not differences:
        return
    if saved.get("name") not in (None, args.name):
        differences.append(f"the run's name {saved['name']!r} there, {args.name!r} here")
    where = "checkpoint.path" if args.checkpoint.path else "dump_dir"
    raise LaunchError(f"{where} {checkpoint_root(args) if args.checkpoint.path else args.dump_dir} holds a run of "
                      f"another model (its newest checkpoint {ckpt}: {'; '.join(differences)}), which this config "
                      f"cannot resume; pick another {where} for this config (nothing in this one was changed)")


def schedule_notice(args, step: int) -> Optional[str]:
    """The line a resume from `step` with another `steps` logs: the schedule is laid over the new length, so the lr
    jumps (a longer run: back up the cosine; a shorter one: down). None when `steps` is unchanged. The step after
    the resume still trains at the lr its checkpoint saved; the new schedule sets the one after."""
    found = saved_run(args)
    old = found[1].get("steps") if found else None
    if old is None or old == args.steps:
        return None
    from lingua.optim import lr_factor

    def lr(step_done: int, n_steps: int) -> float:  # the lr of the step after `step_done` updates
        return args.optim.lr * lr_factor(step_done, args.optim, n_steps)

    keep = f"; relaunch with steps={old} to keep the run's own schedule" if step < old else ""
    return (f"resuming a run of steps={old} with steps={args.steps}: the {args.optim.scheduler} lr schedule is "
            f"stretched over {args.steps} steps, so the lr goes from {lr(step - 1, old):.2e} at step {step} to "
            f"{lr(step + 1, args.steps):.2e} at step {step + 2} (the run of {old} steps: "
            f"{lr(min(step + 1, old), old):.2e}){keep}")
