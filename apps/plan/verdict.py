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

What the teacher is worth comes from a measurement named with its provenance, never from published constants,
and it is finite: a measured multiplier, or the bound the study's CE budgets allowed (where KD beat every CE budget
and CE had stopped improving, the largest multiplier the study measured for that arm, and no more). The
measurement: the user's own pilot of `apps.studies.kd` at their sizes (`kd_measurement=<its results.json>`),
else this repository's studies: docs/kd_study/results.json (one pass over fresh data) for a plan with
unique_tokens=0, docs/kd_study/wall/results.json (U unique tokens read for 1 to 16 epochs) for any plan with
unique_tokens, read at its nearest epochs, so the reading does not jump at one epoch. A one-pass study's
multiplier counts fresh tokens, so it is compared with the break-even in effective tokens; a data-wall study's
counts tokens over the same unique data, so it is compared with 1 + overhead. Where the plan leaves the
measurement (sizes, epochs, U/V, output, k, alpha, temperature, divergence: evidence.py) the verdict says "not
measured here" and reads the nearest measurement.
"""

import json
import math
from pathlib import Path
from typing import Optional

from apps.plan.evidence import measured_settings, unmeasured
from lingua.errors import DataError, MissingPathError

REPO_MEASUREMENT = "docs/kd_study/results.json"
REPO_WALL_MEASUREMENT = "docs/kd_study/wall/results.json"
MUENNIGHOFF_R_D = 15.4  # R_D*, the repetitions after which repeated data's value has decayed by 1/e (their fit)
MAX_CACHE_RUNS = 10_000  # beyond this many runs sharing one cache the plan says "do not distill"


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


def measurement_path(path: Optional[str], unique: float = 0.0) -> tuple[Path, str, str, str]:
    """(the file, its name as printed, whose, why this one): the user's file, else this repository's study of the
    plan's kind of data: the data-wall study for any plan with unique_tokens (finite data, read at its nearest
    epochs, so the reading moves continuously through one epoch), the one-pass study for fresh data."""
    if path:
        return Path(path).expanduser(), str(path), "your", "kd_measurement= names it"
    if unique > 0:
        name = REPO_WALL_MEASUREMENT
        why = "unique_tokens is set: finite data, the data-wall study at its nearest epochs"
    else:
        name, why = REPO_MEASUREMENT, "unique_tokens=0: every token fresh, the one-pass study"
    return Path(__file__).resolve().parents[2] / name, name, "this repository's", why


def arm_multiplier(arm: dict) -> tuple[Optional[float], Optional[str], Optional[float], Optional[float]]:
    """(multiplier or its bound, None | "at_least" | "at_most", low, high) of a KD arm's token_multiplier."""
    tm = arm["token_multiplier"]
    if tm["mean"] is not None:
        return tm["mean"], None, tm["min"], tm["max"]
    per_seed = list(tm["per_seed"].values())
    lower = [v["at_least"] for v in per_seed if "at_least" in v]
    upper = [v["at_most"] for v in per_seed if "at_most" in v]
    if lower and not upper:
        return min(lower), "at_least", None, None
    return (max(upper) if upper else 1.0), "at_most", None, None


def read_measurement(path: Optional[str], output: str, epochs: float, unique: float = 0.0) -> dict:
    """What a KD study measured for the plan's output format: {multiplier, low, high, bound, arm, kind, epochs,
    epoch_range, student, teacher, tokens, unique_tokens, settings, best, pilot, source, why} (pilot: a results.json
    of `python -m apps.plan.pilot`, the one-pass shape); the arm is kd_<output>64
    where there is one, else the first KD arm. `multiplier` is finite: a measured mean, or the bound the study's
    CE budgets allowed; where KD beat every CE budget and CE had stopped improving ("beyond"), the largest
    multiplier the study measured for that arm at any epochs (`best`), never infinity."""
    file, name, owner, why = measurement_path(path, unique)
    if not file.is_file():
        raise MissingPathError(f"kd_measurement={path or name} does not exist; pass the results.json of a "
                               f"`python -m apps.studies.kd` run (or leave it out for this repository's).")
    try:
        results = json.loads(file.read_text())
        compute = results["compute"]
        sizes = {"student": compute["student"]["params"], "teacher": compute["teacher"]["params"]}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise DataError(f"kd_measurement={path} is not a results.json written by apps.studies.kd; pass one "
                        f"(its `compute` and `arms` are what the verdict reads).") from None
    if results.get("mode") == "data_wall":
        budgets = {float(e): budget["arms"] for e, budget in results["epochs"].items()}
        measured_epochs = min(budgets, key=lambda e: abs(math.log(e / max(epochs, 1e-9))))
        arms, kind, unique_measured = budgets[measured_epochs], "data_wall", results["setup"]["unique_tokens"]
        tokens = unique_measured * measured_epochs
    else:
        measured_epochs, arms, kind, unique_measured = 1.0, results["arms"], "one_pass", 0
        budgets = {1.0: arms}
        tokens = results["setup"]["tokens_per_run"]
    kd_arms = [n for n, arm in arms.items() if "token_multiplier" in arm]
    if not kd_arms:
        raise DataError(f"kd_measurement={path} holds no KD arm with a token multiplier; finish the study's runs "
                        f"(or its --report-only) first.")
    arm = next((n for n in kd_arms if n == f"kd_{output}64"), kd_arms[0])
    if arms[arm]["token_multiplier"]["mean"] is None and not arms[arm]["token_multiplier"]["per_seed"]:
        raise DataError(f"kd_measurement={path}: {arm} has no seed with a token multiplier; finish the study's "
                        f"runs (or its --report-only) first.")
    multiplier, bound, low, high = arm_multiplier(arms[arm])
    # The largest multiplier (or lower bound) measured for this arm at any epochs, with where.
    measured_anywhere = [(arm_multiplier(b[arm])[0], e) for e, b in budgets.items()
                         if arm in b and "token_multiplier" in b[arm] and arm_multiplier(b[arm])[1] != "at_most"]
    best = max(measured_anywhere, default=(multiplier, measured_epochs))
    wall = results.get("wall", {})
    worst_kd = max((seed["final_heldout_ce"] for seed in arms[arm].get("seeds", {}).values()), default=math.inf)
    if bound == "at_least" and kind == "data_wall" and wall.get("stopped_improving") \
            and worst_kd < wall.get("best_heldout_ce", -math.inf):
        # KD, every seed, below the best CE-only reached at any budget, and CE had stopped improving: more CE
        # tokens did not get there. Worth at least what the study measured anywhere, and no more is claimed.
        bound, multiplier = "beyond", max(multiplier, best[0])
    settings = measured_settings(results, arm, arms[arm].get("overrides", []), file)
    return {"source": name, "owner": owner, "why": why, "arm": arm, "kind": kind, "epochs": float(measured_epochs),
            "epoch_range": [min(budgets), max(budgets)], "tokens": tokens, "unique_tokens": unique_measured,
            "multiplier": multiplier, "bound": bound, "low": low, "high": high,
            "best": {"multiplier": best[0], "epochs": best[1]}, "settings": settings,
            "pilot": results.get("mode") == "pilot", **sizes}


def distill_verdict(teacher_flops: float, student_flops: float, tokens: float, unique: float, runs: int,
                    road: str, measured: dict, student: int, teacher: int, r_star: float = MUENNIGHOFF_R_D,
                    settings: Optional[dict] = None, pilot_tokens: Optional[float] = None) -> dict:
    """The verdict for a run of `tokens` student tokens over `unique` unique ones (0: fresh), `runs` runs sharing
    one cache, the planner's cheaper `road` ("online" | "cache"), against the `measured` multiplier; `settings`:
    the plan's {output, k, alpha, temperature, divergence, vocab} (None: the measurement's); `pilot_tokens`: the
    KD tokens of this plan's pilot (what a pilot's measurement is compared with)."""
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
    worth = min(expected, 1.0) if measured["bound"] == "at_most" else expected  # finite: measured, or its bound

    def pays(overhead: float) -> bool:
        return worth > needed(overhead)

    min_runs = next((n for n in range(1, MAX_CACHE_RUNS + 1) if pays(cache_overhead(ratio, tokens, unique, n))),
                    None)
    if road == "online" and pays(online):
        pays_on, sentence = "online", "distill online"
    elif min_runs is not None and runs >= min_runs:
        pays_on, sentence = "cache", f"distill from a cache shared by at least {min_runs} run(s) (you plan {runs})"
    else:
        pays_on, sentence = None, "do not distill: train CE-only on more tokens" + (
            f" (a cache would pay if shared by at least {min_runs} runs; you plan {runs})" if min_runs else "")
    plan = {"student": student, "teacher": teacher, "tokens": tokens, "epochs": epochs, "unique_tokens": unique,
            **(settings or {}), **({"pilot_tokens": pilot_tokens} if pilot_tokens else {})}
    outside = unmeasured(measured, plan)
    needed_road = needed(online if road == "online" else cache)
    return {
        "teacher_over_student_flops": round(ratio, 4), "epochs": round(epochs, 4), "unique_tokens": unique,
        "runs": runs,
        "overhead": {"online": round(online, 4), "cache": round(cache, 4)},
        "break_even": {"fresh_online": round(1 + online, 4), "fresh_cache": round(1 + ratio / runs, 4),
                       "repeated_online": round(break_even(online, tokens, unique, r_star), 4),
                       "repeated_cache": round(break_even(cache, tokens, unique, r_star), 4),
                       "compared": "tokens over the same unique data" if measured["kind"] == "data_wall"
                       else "effective tokens", "r_star": r_star},
        "measured": measured, "expected": expected, "worth": worth, "road": road,
        "needed_on_road": round(needed_road, 4), "min_cache_runs": min_runs, "pays_on": pays_on,
        "unmeasured": outside, "measured_here": not outside,
        "verdict": sentence if not outside else f"not measured here: on the nearest measurement, {sentence}",
    }
