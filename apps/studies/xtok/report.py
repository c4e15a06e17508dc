"""The cross-tokenizer study's report (apps/studies/xtok/study.py): results.json and table.md from the finished runs.

Per arm and held-out split: bits per byte per seed, mean, sample std and spread (max - min) over seeds; for each
KD arm the paired difference to its CE-only baseline (same tokenizer, same seed: same init, same windows) and
whether it beats that baseline beyond the seed spread: every seed's paired difference below 0, and the mean
difference larger than both arms' spread (max - min).
"""

import json
import statistics
from pathlib import Path

SPLITS = ("pydocs", "repodocs")


def spread_stats(values: list[float]) -> dict:
    """mean, sample std (0 for one value), min, max and spread (max - min) of `values`."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "spread": max(values) - min(values), "n": len(values)}


def versus_baseline(arm: dict, base: dict, split: str) -> dict:
    """The arm minus its baseline on `split`, paired by seed, and the verdict (see the module docstring)."""
    key = f"bpb_{split}"
    paired = {s: arm["seeds"][s][key] - base["seeds"][s][key] for s in arm["seeds"] if s in base["seeds"]}
    if not paired:
        return {"paired": {}, "verdict": "no common seed"}
    diffs = list(paired.values())
    margin = max(arm["bpb"][split]["spread"], base["bpb"][split]["spread"])
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        verdict = "1 seed: no spread"
    elif max(diffs) < 0 and -mean > margin:
        verdict = "beats"
    elif min(diffs) > 0 and mean > margin:
        verdict = "worse"
    else:
        verdict = "within spread"
    return {"paired": paired, "mean": mean, "min": min(diffs), "max": max(diffs), "margin": margin, "verdict": verdict}


def collect(arms_spec: dict, finished) -> dict:
    """arm -> {tokenizer, is_ce, baseline, seeds: {seed: row numbers}, bpb: {split: stats}, aligned}."""
    arms = {}
    for run in finished:
        row = json.loads((run.dump_dir / "metrics.jsonl").read_text().splitlines()[-1])
        spec = arms_spec[run.arm]
        arm = arms.setdefault(run.arm, {"tokenizer": spec.tokenizer, "cache": spec.cache, "is_ce": spec.is_ce,
                                        "baseline": spec.baseline, "overrides": list(spec.settings),
                                        "steps": run.steps, "seeds": {}})
        arm["seeds"][str(run.seed)] = {f"bpb_{s}": row[f"eval/bpb_{s}"] for s in SPLITS} | {
            "ce_per_token_pydocs": row["eval/loss"], "ce_per_token_repodocs": row["eval/loss_repodocs"],
            "train_loss": row["loss/total"], "wall_s": row["wall_s"], "aligned": row.get("kd/aligned")}
    for arm in arms.values():
        arm["bpb"] = {s: spread_stats([seed[f"bpb_{s}"] for seed in arm["seeds"].values()]) for s in SPLITS}
        arm["wall_s"] = sum(seed["wall_s"] for seed in arm["seeds"].values())
    for arm in arms.values():
        if arm["baseline"] in arms:
            arm["versus_baseline"] = {s: versus_baseline(arm, arms[arm["baseline"]], s) for s in SPLITS}
    return arms


def cell(stats: dict) -> str:
    return f"{stats['mean']:.4f} ± {stats['std']:.4f} ({stats['spread']:.4f})"


def table(results: dict) -> str:
    setup = results["setup"]
    lines = ["| arm | tokenizer | settings | kd/aligned | pydocs bpb: mean ± std (max-min) | repodocs bpb: mean "
             "± std (max-min) | minus its CE-only, paired: pydocs / repodocs | beats its CE-only beyond the seed "
             "spread? pydocs / repodocs |", "|" + "---|" * 8]
    for name, arm in results["arms"].items():
        side = setup["sides"].get(arm["cache"], {})
        tokenizer = (f"own BPE, {side.get('n_words', '?')} ids" if arm["tokenizer"] == "own"
                     else f"teacher's, {side.get('n_words', '?')} ids")
        aligned = "—" if arm["is_ce"] or arm["tokenizer"] != "own" else \
            f"{statistics.fmean(s['aligned'] for s in arm['seeds'].values()):.3f}"
        versus = arm.get("versus_baseline")
        minus = "—" if versus is None else " / ".join(
            f"{versus[s]['mean']:+.4f} ({versus[s]['min']:+.4f} to {versus[s]['max']:+.4f})" if "mean" in versus[s]
            else versus[s]["verdict"] for s in SPLITS)
        verdict = "— (baseline)" if versus is None else " / ".join(versus[s]["verdict"] for s in SPLITS)
        lines.append(f"| {name} | {tokenizer} | {' '.join(arm['overrides'])} | {aligned} | "
                     f"{cell(arm['bpb']['pydocs'])} | {cell(arm['bpb']['repodocs'])} | {minus} | {verdict} |")
    teacher = setup.get("teacher_bpb")
    if teacher:
        repodocs = "not scored (--teacher-bpb)" if teacher["repodocs"] is None else f"{teacher['repodocs']:.4f}"
        lines.append(f"| teacher | teacher's | {Path(setup['teacher']).name} | — | {teacher['pydocs']:.4f} | "
                     f"{repodocs} | — | — |")
    lines.append("")
    lines.append("Per seed (bits per byte, pydocs / repodocs):")
    lines.append("")
    for name, arm in results["arms"].items():
        per_seed = ", ".join(f"seed {s}: {v['bpb_pydocs']:.4f} / {v['bpb_repodocs']:.4f}"
                             for s, v in sorted(arm["seeds"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"- {name}: {per_seed}")
    return "\n".join(lines) + "\n"


def report(setup: dict, arms_spec: dict, runs: list, finished: list, out: Path, wall_s: float,
           finished_at: str) -> dict:
    """results.json and table.md from the finished runs; returns the results."""
    results = {"mode": "cross_tokenizer", "setup": setup, "arms": collect(arms_spec, finished),
               "study_wall_s": wall_s, "finished": finished_at,
               "verdict_rule": "beats: every seed's paired difference (arm minus its CE-only, same seed) below 0 and "
                               "the mean difference larger than both arms' seed spread (max - min)"}
    missing = [f"{r.arm} seed {r.seed}" for r in runs if r not in finished]
    if missing:
        results["missing_runs"] = missing
    for name, text in (("results.json", json.dumps(results, indent=1) + "\n"), ("table.md", table(results))):
        tmp = out / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    print(table(results))
    return results
