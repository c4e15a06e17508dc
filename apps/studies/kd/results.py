"""results.json's numbers: per arm and seed the held-out curves, pairing by seed, the token multiplier, FLOPs."""

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Optional

from apps.studies.kd.arms import ARMS, CACHES, Run
from apps.studies.kd.disk import read_cloze, read_wall_s
from apps.main.train import TrainArgs
from lingua.run.dump_dir import eval_rows


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}

def collect(runs: list[Run], tokens_per_step: int) -> dict:
    """results.json's `arms`: per arm its settings, per seed the held-out curve, final CE, tokens, cloze, and
    the spreads; `minus_ce_paired` = the arm minus the 1x CE arm, seed by seed (same init, same windows)."""
    arms: dict = {}
    for run in runs:
        rows = eval_rows(run.dump_dir)
        curve = [{"step": step, "tokens": step * tokens_per_step, "heldout_ce": rows[step]["eval/loss"]}
                 for step in sorted(rows)]
        spec = ARMS[run.arm]
        arm = arms.setdefault(run.arm, {"overrides": list(spec.overrides) + list(CACHES.get(spec.cache, ())),
                                        "source": f"cache_{spec.cache}" if spec.cache else "corpus",
                                        "multiple": spec.multiple, "steps": run.steps, "seeds": {}})
        seed = {"final_heldout_ce": curve[-1]["heldout_ce"], "heldout": curve, "tokens": run.steps * tokens_per_step,
                "wall_s": run.wall_s if run.wall_s is not None else read_wall_s(run.dump_dir)}
        cloze = read_cloze(run.dump_dir, run.steps)
        if cloze is not None:
            seed.update(cloze_acc=cloze["acc"], cloze_acc_norm=cloze["acc_norm"], cloze_n=cloze["n"])
        arm["seeds"][str(run.seed)] = seed
    order = list(ARMS)  # the arms in ARMS's order (CE budgets, then KD), whichever phase ran them
    arms = dict(sorted(arms.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    for name, arm in arms.items():
        arm["seeds"] = dict(sorted(arm["seeds"].items(), key=lambda kv: int(kv[0])))
        arm["tokens"] = next(iter(arm["seeds"].values()))["tokens"]
        finals = [seed["final_heldout_ce"] for seed in arm["seeds"].values()]
        arm["final_heldout_ce"] = spread(finals)
        accs = [seed["cloze_acc"] for seed in arm["seeds"].values() if "cloze_acc" in seed]
        if accs:
            arm["cloze_acc"] = spread(accs)
        if "ce" in arms and name != "ce":
            arm["minus_ce_paired"] = paired_difference(arm, arms["ce"])
    return arms


def paired_difference(arm: dict, base: dict) -> Optional[dict]:
    diffs = [seed["final_heldout_ce"] - base["seeds"][s]["final_heldout_ce"]
             for s, seed in arm["seeds"].items() if s in base["seeds"]]
    return spread(diffs) if diffs else None


def interpolate_multiplier(ce_finals: dict[float, float], kd_final: float) -> dict:
    """The CE tokens (a multiple of the KD arm's) at which CE-only reaches `kd_final`.

    `ce_finals`: CE budget multiple -> that budget's final held-out CE (each a complete lr schedule).
    Linear in log(tokens) between the two budgets that bracket `kd_final` (the first such pair, smallest
    budgets first). KD worse than the 1x CE gives {"value": None, "at_most": 1.0} (no extrapolation
    below 1x); KD below every budget gives {"value": None, "at_least": the largest multiple}.
    """
    points = sorted(ce_finals.items())
    if not points:
        return {"value": None}
    first_m, first_ce = points[0]
    if kd_final > first_ce:
        return {"value": None, "at_most": float(first_m)}
    for i, (m0, c0) in enumerate(points):
        if c0 == kd_final:  # an exact hit on a budget
            return {"value": float(m0), "between": [m0, m0]}
        if i + 1 < len(points) and c0 > kd_final > points[i + 1][1]:
            m1, c1 = points[i + 1]
            frac = (c0 - kd_final) / (c0 - c1)
            return {"value": math.exp(math.log(m0) + frac * (math.log(m1) - math.log(m0))), "between": [m0, m1]}
    return {"value": None, "at_least": float(max(m for m, _ in points))}


def ce_curves(arms: dict) -> dict[str, dict[float, float]]:
    """seed -> {CE multiple: that CE arm's final held-out CE}."""
    curves: dict[str, dict[float, float]] = {}
    for name, arm in arms.items():
        if name in ARMS and ARMS[name].is_ce:
            for seed, values in arm["seeds"].items():
                curves.setdefault(seed, {})[float(ARMS[name].multiple)] = values["final_heldout_ce"]
    return curves


def token_multipliers(arms: dict) -> None:
    """Adds `token_multiplier {mean, min, max, per_seed}` to every KD arm (mean/min/max over the seeds where
    it is a value; bounds stay per seed) and `ce_tokens_equivalent` (the mean multiplier x the arm's tokens)."""
    curves = ce_curves(arms)
    for name, arm in arms.items():
        if name not in ARMS or ARMS[name].is_ce:
            continue
        arm["token_multiplier"] = token_multiplier({
            seed: interpolate_multiplier(curves.get(seed, {}), values["final_heldout_ce"])
            for seed, values in arm["seeds"].items()})
        mean = arm["token_multiplier"]["mean"]
        arm["ce_tokens_equivalent"] = mean * arm["tokens"] if mean is not None else None


def token_multiplier(per_seed: dict[str, dict]) -> dict:
    """A KD arm's `token_multiplier` from its seeds' `interpolate_multiplier` results: {mean, min, max} over the
    seeds where it is a value (None where none is), and `per_seed` (bounds stay per seed)."""
    values = [v["value"] for v in per_seed.values() if v["value"] is not None]
    return {"mean": statistics.fmean(values) if values else None, "min": min(values) if values else None,
            "max": max(values) if values else None, "per_seed": per_seed}


def conditional_arm_needed(arms: dict) -> tuple[bool, str]:
    """Whether ce_4x must run: some (KD arm, seed) final below that seed's ce_2x final (the 2x curve does not
    reach it). Returns (needed, the reason in a sentence)."""
    if "ce_2x" not in arms:
        return False, "ce_2x was not run, so there is no 2x curve to decide on"
    below = [f"{name} seed {seed} ({values['final_heldout_ce']:.4f} < {arms['ce_2x']['seeds'][seed]['final_heldout_ce']:.4f})"
             for name, arm in arms.items() if name in ARMS and not ARMS[name].is_ce
             for seed, values in arm["seeds"].items()
             if seed in arms["ce_2x"]["seeds"]
             and values["final_heldout_ce"] < arms["ce_2x"]["seeds"][seed]["final_heldout_ce"]]
    if below:
        return True, "below its seed's ce_2x final: " + ", ".join(below)
    return False, "every KD arm's final held-out CE is above its seed's ce_2x final (the 2x budget reaches it)"

def count_safetensors_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def teacher_flops_per_token(teacher_dir: str, seq_len: int) -> dict:
    """One teacher forward per token: the forward third of the trainer's formula (6N + 12*L*D*S)/3 = 2N + 4*L*D*S,
    N = the matmul parameters (every parameter when the head is tied to the embedding, else all but the
    embedding lookup)."""
    from apps.main.transformer import get_num_flop_per_token

    config = json.loads((Path(teacher_dir) / "config.json").read_text())
    n_params = count_safetensors_params(Path(teacher_dir))
    embedding = config["vocab_size"] * config["hidden_size"]
    matmul = n_params if config.get("tie_word_embeddings", False) else n_params - embedding
    per_token = get_num_flop_per_token(matmul, config["num_hidden_layers"], config["hidden_size"], seq_len) / 3
    return {"params": n_params, "matmul_params": matmul, "forward_per_token": per_token}


def student_flops_per_token(args: TrainArgs) -> dict:
    """The trainer's own count (apps/main/train.py, its MFU): 6N + 12*L*D*S per trained token, N the
    parameters less the embedding lookup (tied: the head is the only copy, counted once)."""
    import torch

    from apps.main.transformer import LMTransformer, get_num_flop_per_token
    from lingua.tokenizer import build_tokenizer

    vocab = build_tokenizer(args.data.tokenizer).n_words
    with torch.device("meta"):
        model = LMTransformer(replace(args.model, vocab_size=vocab))
    n_params = sum(p.numel() for p in model.parameters())
    matmul = n_params - (0 if args.model.tie_embeddings else vocab * args.model.dim)
    return {"params": n_params, "matmul_params": matmul, "train_per_token": get_num_flop_per_token(
        matmul, args.model.n_layers, args.model.dim, args.data.seq_len)}


def add_flops(arms: dict, student_per_token: float, teacher_per_token: float, caches: dict) -> None:
    """Per arm and seed (`flops`, and the arm's mean): training FLOPs only (held-out evals left out).

    student              student_per_token x tokens trained
    teacher_online       teacher_per_token x tokens trained (online KD: the teacher runs with every run)
    teacher_cache_amortized  the cache's build (teacher_per_token x its cached tokens) / the runs reading it
    total_online / total_cache  student + the teacher's share either way (CE-only: the student alone)
    """
    for name, arm in arms.items():
        is_kd = name in ARMS and ARMS[name].cache is not None
        cache = caches.get(ARMS[name].cache) if is_kd else None
        for seed in arm["seeds"].values():
            student = student_per_token * seed["tokens"]
            online = teacher_per_token * seed["tokens"] if is_kd else 0.0
            amortized = cache["teacher_flops"] / max(cache["runs_reading"], 1) if cache is not None else 0.0
            seed["flops"] = {"student": student, "teacher_online": online, "teacher_cache_amortized": amortized,
                             "total_online": student + online, "total_cache": student + amortized}
        keys = next(iter(arm["seeds"].values()))["flops"]
        arm["flops"] = {key: statistics.fmean(s["flops"][key] for s in arm["seeds"].values()) for key in keys}


def curve_flops(arm_name: str, tokens: float, results: dict, mode: str) -> float:
    """Total training FLOPs at `tokens` into a run: online pays the teacher per token, the cache its share up front."""
    compute = results["compute"]
    student = compute["student"]["train_per_token"] * tokens
    spec = ARMS.get(arm_name)
    if spec is None or spec.cache is None:
        return student
    if mode == "online":
        return student + compute["teacher"]["forward_per_token"] * tokens
    cache = results["caches"].get(spec.cache)
    return student + (cache["teacher_flops"] / max(cache["runs_reading"], 1) if cache else 0.0)
