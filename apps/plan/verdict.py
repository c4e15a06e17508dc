"""Should I distill? The teacher's cost per trained token against what a measurement says it is worth.

The teacher's forward costs `ratio` = 2N_T/6N_S (with attention: the planner's per-token FLOPs) of the student's
training per token. Online it runs on every trained token, every epoch: overhead = ratio. A cache is written once
over the unique tokens and read by every epoch of every run that shares it: overhead = ratio / (runs x epochs).
The same compute trains CE-only on (1 + overhead) x the tokens, so the teacher pays when it is worth more than
that many tokens:

- on fresh data, the break-even token multiplier is 1 + overhead;
- behind a data wall (U unique tokens read E = D/U times) extra CE tokens are repeats and are worth less:
  Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (arXiv 2305.16264), fit the effective data
  of U unique tokens repeated R more times as U + U R_D* (1 - exp(-R / R_D*)), R_D* ~ 15.4. The break-even is
  then effective((1 + overhead) D) / effective(D), below 1 + overhead.

What the teacher is worth comes from a measurement named with its provenance, never from published constants:
this repository's studies (docs/kd_study/results.json, one pass over fresh data, and docs/kd_study/wall/results.json,
U unique tokens read for 1 to 16 epochs, the default for a plan that repeats its data; a 7M student: their
multipliers are facts of those sizes, and the plan says so when its sizes differ) or the user's own pilot run
of `apps.bench.kd_study` at their sizes (`kd_measurement=<its results.json>`). A one-pass study's multiplier counts
fresh tokens, so it is compared with the break-even in effective tokens; a data-wall study's (`--wall`) counts
tokens over the same unique data at a number of epochs, so its multiplier at the epochs nearest the plan's is
compared with 1 + overhead.
"""

import json
import math
from pathlib import Path
from typing import Optional

from lingua.errors import DataError, MissingPathError

REPO_MEASUREMENT = "docs/kd_study/results.json"
REPO_WALL_MEASUREMENT = "docs/kd_study/wall/results.json"
MUENNIGHOFF_R_D = 15.4  # R_D*, the repetitions after which repeated data's value has decayed by 1/e (their fit)
MAX_CACHE_RUNS = 10_000  # beyond this many runs sharing one cache the plan says "do not distill"
SIZE_TOLERANCE = 0.1  # a measurement's student, teacher or tokens further than this (relative) from the plan's


def effective_tokens(tokens: float, unique: float, r_star: float = MUENNIGHOFF_R_D) -> float:
    """Muennighoff et al. 2023's effective data of `tokens` read from `unique` unique tokens (0: all fresh):
    U + U R* (1 - exp(-R / R*)) with R = tokens / U - 1 repetitions after the first epoch."""
    if unique <= 0 or tokens <= unique:
        return float(tokens)
    repeats = tokens / unique - 1
    return unique + unique * r_star * (1 - math.exp(-repeats / r_star))


def break_even(overhead: float, tokens: float, unique: float, r_star: float = MUENNIGHOFF_R_D) -> float:
    """The token multiplier (in effective tokens) the teacher must be worth to beat CE-only at equal compute."""
    return effective_tokens((1 + overhead) * tokens, unique, r_star) / effective_tokens(tokens, unique, r_star)


def cache_overhead(ratio: float, tokens: float, unique: float, runs: int) -> float:
    """Teacher FLOPs per trained student FLOP from a cache written once over the unique tokens and shared."""
    cached = min(unique, tokens) if unique > 0 else tokens
    return ratio * cached / tokens / runs


def measurement_path(path: Optional[str], epochs: float = 1.0) -> tuple[Path, str, str]:
    """(the file, its name as printed, whose): the user's file, else this repository's study nearest the plan: the
    data-wall study for a plan that reads its unique data more than once, the one-pass study otherwise."""
    if path:
        return Path(path).expanduser(), str(path), "your"
    name = REPO_WALL_MEASUREMENT if epochs > 1 else REPO_MEASUREMENT
    return Path(__file__).resolve().parents[2] / name, name, "this repository's"


def read_measurement(path: Optional[str], output: str, epochs: float) -> dict:
    """What a KD study measured for the plan's output format: {multiplier, low, high, bound, arm, kind, epochs,
    student, teacher, tokens, source}; the arm is kd_<output>64 where there is one, else the first KD arm."""
    file, name, owner = measurement_path(path, epochs)
    if not file.is_file():
        raise MissingPathError(f"kd_measurement={path or name} does not exist; pass the results.json of a "
                               f"`python -m apps.bench.kd_study` run (or leave it out for this repository's).")
    try:
        results = json.loads(file.read_text())
        compute = results["compute"]
        sizes = {"student": compute["student"]["params"], "teacher": compute["teacher"]["params"]}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise DataError(f"kd_measurement={path} is not a results.json written by apps.bench.kd_study; pass one "
                        f"(its `compute` and `arms` are what the verdict reads).") from None
    if results.get("mode") == "data_wall":
        measured_epochs = sorted(results["epochs"], key=lambda e: abs(math.log(float(e) / max(epochs, 1e-9))))[0]
        arms, kind = results["epochs"][measured_epochs]["arms"], "data_wall"
        tokens = results["setup"]["unique_tokens"] * float(measured_epochs)
    else:
        measured_epochs, arms, kind = 1, results["arms"], "one_pass"
        tokens = results["setup"]["tokens_per_run"]
    kd_arms = [n for n, arm in arms.items() if "token_multiplier" in arm]
    if not kd_arms:
        raise DataError(f"kd_measurement={path} holds no KD arm with a token multiplier; finish the study's runs "
                        f"(or its --report-only) first.")
    arm = next((n for n in kd_arms if n == f"kd_{output}64"), kd_arms[0])
    tm = arms[arm]["token_multiplier"]
    per_seed = list(tm["per_seed"].values())
    bound = None
    if tm["mean"] is None:
        if not per_seed:
            raise DataError(f"kd_measurement={path}: {arm} has no seed with a token multiplier; finish the study's "
                            f"runs (or its --report-only) first.")
        lower = [v["at_least"] for v in per_seed if "at_least" in v]
        upper = [v["at_most"] for v in per_seed if "at_most" in v]
        bound = ("at_least", min(lower)) if lower and not upper else ("at_most", max(upper) if upper else 1.0)
        wall = results.get("wall", {})
        worst_kd = max((seed["final_heldout_ce"] for seed in arms[arm].get("seeds", {}).values()), default=math.inf)
        if bound[0] == "at_least" and kind == "data_wall" and wall.get("stopped_improving") \
                and worst_kd < wall.get("best_heldout_ce", -math.inf):
            # KD, every seed, below the best CE-only reached at any budget, and CE-only had stopped improving:
            # more CE tokens never get there. (Below only the larger budgets is not that: an earlier, cheaper CE
            # budget may still be better.)
            bound = ("beyond", None)
    return {"source": name, "owner": owner, "arm": arm, "kind": kind, "epochs": float(measured_epochs),
            "tokens": tokens,
            "multiplier": tm["mean"] if tm["mean"] is not None else bound[1], "bound": bound and bound[0],
            "low": tm["min"], "high": tm["max"], **sizes}


def size_warnings(measured: dict, student: int, teacher: int, tokens: float) -> list[list]:
    """[name, measured, planned] of each size that differs from the measurement's by more than SIZE_TOLERANCE."""
    pairs = (("student", measured["student"], student), ("teacher", measured["teacher"], teacher),
             ("tokens", measured["tokens"], tokens))
    return [[name, theirs, ours] for name, theirs, ours in pairs if abs(ours - theirs) > SIZE_TOLERANCE * theirs]


def distill_verdict(teacher_flops: float, student_flops: float, tokens: float, unique: float, runs: int,
                    road: str, measured: dict, student: int, teacher: int, r_star: float = MUENNIGHOFF_R_D) -> dict:
    """The verdict for a run of `tokens` student tokens over `unique` unique ones (0: fresh), `runs` runs sharing
    one cache, the planner's cheaper `road` ("online" | "cache"), against the `measured` multiplier."""
    ratio = teacher_flops / student_flops
    epochs = tokens / unique if unique > 0 else 1.0
    online = ratio
    cache = cache_overhead(ratio, tokens, unique, runs)
    if measured["kind"] == "data_wall":  # tokens over the same unique data: CE's own curve already holds the repeats
        def needed(overhead: float) -> float:
            return 1 + overhead
    else:  # fresh tokens: compared in effective tokens

        def needed(overhead: float) -> float:
            return break_even(overhead, tokens, unique, r_star)

    expected = measured["multiplier"]
    worth = {"at_most": min(expected or 1.0, 1.0), "beyond": math.inf}.get(measured["bound"], expected)

    def pays(overhead: float) -> bool:
        return worth > needed(overhead)

    min_runs = next((n for n in range(1, MAX_CACHE_RUNS + 1) if pays(cache_overhead(ratio, tokens, unique, n))),
                    None)
    if road == "online" and pays(online):
        sentence = "distill online"
    elif min_runs is not None and runs >= min_runs:
        sentence = f"distill from a cache shared by at least {min_runs} run(s) (you plan {runs})"
    else:
        sentence = "do not distill: train CE-only on more tokens" + (
            f" (a cache would pay if shared by at least {min_runs} runs; you plan {runs})" if min_runs else "")
    return {
        "teacher_over_student_flops": round(ratio, 4), "epochs": round(epochs, 4), "unique_tokens": unique,
        "runs": runs,
        "overhead": {"online": round(online, 4), "cache": round(cache, 4)},
        "break_even": {"fresh_online": round(1 + online, 4), "fresh_cache": round(1 + ratio / runs, 4),
                       "repeated_online": round(break_even(online, tokens, unique, r_star), 4),
                       "repeated_cache": round(break_even(cache, tokens, unique, r_star), 4),
                       "compared": "tokens over the same unique data" if measured["kind"] == "data_wall"
                       else "effective tokens", "r_star": r_star},
        "measured": measured, "expected": expected, "min_cache_runs": min_runs,
        "warnings": size_warnings(measured, student, teacher, tokens), "verdict": sentence,
    }
