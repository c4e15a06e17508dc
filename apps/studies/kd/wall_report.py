"""The data-wall study's report: held-out CE against epochs and against total FLOPs, the CE frontier (the best
weight decay at each budget), where each KD arm crosses it (at equal tokens, and at equal compute with the teacher
counted once), with the spread over seeds; results.json (`mode: data_wall`), table.md, kd_wall.png."""

import json
import math
import statistics
import time
from pathlib import Path
from typing import Optional

from apps.studies.kd.arms import WALL_ARMS
from apps.studies.kd.disk import (build_record_path, cache_dir_of, cache_is_complete, now_iso, read_cloze,
                                      read_wall_s, teacher_heldout_ce)
from apps.studies.kd.render import format_flops, format_multiplier, format_tokens
from apps.studies.kd.results import (interpolate_multiplier, spread, student_flops_per_token,
                                         teacher_flops_per_token)
from lingua.distillation.cache.store import CacheManifest
from lingua.run.dump_dir import eval_rows

COLORS = {"ce": "#2171b5", "ce_wd10x": "#6baed6", "kd_topk64": "tab:orange", "kd_sampled64": "tab:green"}


def collect_wall(runs: list, tokens_per_step: int) -> dict:
    """epochs -> {"arms": arm -> {"seeds": seed -> {final_heldout_ce, tokens, wall_s, cloze...}, spreads}}."""
    epochs: dict = {}
    for run in sorted(runs, key=lambda r: (r.epochs, list(WALL_ARMS).index(r.arm), r.seed)):
        rows = eval_rows(run.dump_dir)
        arm = epochs.setdefault(str(run.epochs), {"arms": {}})["arms"].setdefault(run.arm, {
            "is_ce": WALL_ARMS[run.arm].is_ce, "overrides": list(WALL_ARMS[run.arm].overrides), "steps": run.steps,
            "tokens": run.steps * tokens_per_step, "seeds": {}})
        final = rows[max(rows)]
        seed = {"final_heldout_ce": final["eval/loss"], "tokens": run.steps * tokens_per_step,
                "wall_s": run.wall_s if run.wall_s is not None else read_wall_s(run.dump_dir),
                # the other held-out splits, when the run scored them (the in-process study: eval/loss_<split>)
                **{f"final_heldout_ce_{key[len('eval/loss_'):]}": v for key, v in final.items()
                   if key.startswith("eval/loss_")}}
        cloze = read_cloze(run.dump_dir, run.steps)
        if cloze is not None:
            seed.update(cloze_acc=cloze["acc"], cloze_acc_norm=cloze["acc_norm"], cloze_n=cloze["n"])
        arm["seeds"][str(run.seed)] = seed
    for budget in epochs.values():
        for arm in budget["arms"].values():
            arm["final_heldout_ce"] = spread([s["final_heldout_ce"] for s in arm["seeds"].values()])
            for key in sorted({k for s in arm["seeds"].values() for k in s if k.startswith("final_heldout_ce_")}):
                arm[key] = spread([s[key] for s in arm["seeds"].values() if key in s])
            accs = [s["cloze_acc"] for s in arm["seeds"].values() if "cloze_acc" in s]
            if accs:
                arm["cloze_acc"] = spread(accs)
    return dict(sorted(epochs.items(), key=lambda kv: int(kv[0])))


def add_frontier(epochs: dict) -> None:
    """Each budget's `frontier`: the CE arm (over weight decay) with the lowest mean final held-out CE."""
    for budget in epochs.values():
        ce = {n: a for n, a in budget["arms"].items() if a["is_ce"]}
        if ce:
            best = min(ce, key=lambda n: ce[n]["final_heldout_ce"]["mean"])
            budget["frontier"] = {"arm": best, **ce[best]["final_heldout_ce"],
                                  "per_seed": {s: v["final_heldout_ce"] for s, v in ce[best]["seeds"].items()}}


def add_flops(epochs: dict, student_per_token: float, teacher_per_token: float, unique_tokens: int) -> None:
    """Per arm: student training FLOPs over E x U tokens, plus (KD) the cache's teacher forward over U, once."""
    for budget in epochs.values():
        for arm in budget["arms"].values():
            student = student_per_token * arm["tokens"]
            teacher = 0.0 if arm["is_ce"] else teacher_per_token * unique_tokens
            arm["flops"] = {"student": student, "teacher_once": teacher, "total": student + teacher}
            arm["ce_epochs_at_equal_flops"] = (student + teacher) / (student_per_token * unique_tokens)


def paired(kd: dict, ce: dict) -> Optional[dict]:
    """KD minus CE final held-out CE, seed by seed (same init, same windows), over the seeds both have."""
    diffs = [v["final_heldout_ce"] - ce[s] for s, v in kd["seeds"].items() if s in ce]
    return spread(diffs) if diffs else None


def best_ce_within(points: list[tuple[int, float]], epochs: float) -> Optional[float]:
    """The lowest CE-only result a seed's frontier reaches within `epochs` reads of U (its FLOPs): the budgets run
    up to it and, between two of them, the frontier interpolated linearly in log-epochs at `epochs` itself."""
    within = [ce for e, ce in points if e <= epochs]
    for (e0, c0), (e1, c1) in zip(points, points[1:]):
        if e0 < epochs < e1:
            within.append(c0 + (c1 - c0) * math.log(epochs / e0) / math.log(e1 / e0))
    return min(within) if within else None


def compare(epochs: dict) -> dict:
    """Per KD arm and budget: the token multiplier on the CE frontier (budgets E' >= E), KD minus the frontier at
    equal tokens, and KD minus the best the frontier reaches with no more FLOPs (its epochs interpolated in
    log-epochs, the teacher's forward over U counted once); per KD arm the first budget where it is below the
    frontier either way (mean over seeds, with the paired seed range). Curves that span budgets use the seeds run
    at every budget (the end seeds only compare at equal tokens)."""
    frontier = {int(e): b["frontier"] for e, b in epochs.items() if "frontier" in b}
    complete = set.intersection(*(set(f["per_seed"]) for f in frontier.values())) if frontier else set()
    crossings: dict = {}
    for e, budget in epochs.items():
        for name, arm in budget["arms"].items():
            if arm["is_ce"] or int(e) not in frontier:
                continue
            seeds = {s: v for s, v in arm["seeds"].items() if s in complete}
            per_seed = {s: interpolate_multiplier({e2 / int(e): f["per_seed"][s] for e2, f in frontier.items()
                                                   if e2 >= int(e)}, v["final_heldout_ce"]) for s, v in seeds.items()}
            found = [v["value"] for v in per_seed.values() if v["value"] is not None]
            arm["token_multiplier"] = {"mean": statistics.fmean(found) if found else None,
                                       "min": min(found) if found else None, "max": max(found) if found else None,
                                       "per_seed": per_seed}
            arm["minus_frontier_equal_tokens"] = paired(arm, frontier[int(e)]["per_seed"])
            within = {s: best_ce_within(sorted((e2, f["per_seed"][s]) for e2, f in frontier.items()),
                                        arm["ce_epochs_at_equal_flops"]) for s in seeds}
            if within:
                arm["best_ce_at_no_more_flops"] = {"epochs": arm["ce_epochs_at_equal_flops"],
                                                   "final_heldout_ce": statistics.fmean(within.values())}
                arm["minus_ce_equal_flops"] = paired({"seeds": seeds}, within)
            entry = crossings.setdefault(name, {"equal_tokens": None, "equal_flops": None})
            for key, diff in (("equal_tokens", arm["minus_frontier_equal_tokens"]),
                              ("equal_flops", arm.get("minus_ce_equal_flops"))):
                if entry[key] is None and diff is not None and diff["mean"] < 0:
                    entry[key] = {"epochs": int(e), **diff}
    return crossings


def wall_of(epochs: dict) -> dict:
    """Where the CE frontier is lowest, and whether it had stopped improving by the largest budget."""
    frontier = [(int(e), b["frontier"]["mean"]) for e, b in epochs.items() if "frontier" in b]
    if not frontier:
        return {}
    best_e, best = min(frontier, key=lambda p: p[1])
    last_e, last = frontier[-1]
    stopped = len(frontier) > 1 and last >= frontier[-2][1]
    return {"best_epochs": best_e, "best_heldout_ce": best, "largest_epochs": last_e, "at_largest": last,
            "stopped_improving": stopped}


def table(results: dict) -> str:
    """table.md: every (E, arm), then the frontier, the wall and the crossings."""
    lines = ["| E | arm | tokens | final held-out CE, mean ± std | per seed | total FLOPs | minus CE frontier, equal "
             "tokens (paired) | minus best CE at no more FLOPs | = CE-frontier tokens | pydocs_cloze acc |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e, budget in results["epochs"].items():
        for name, arm in budget["arms"].items():
            final = arm["final_heldout_ce"]
            seeds = ", ".join(f"{s['final_heldout_ce']:.4f}" for s in arm["seeds"].values())
            diff = lambda d: f"{d['mean']:+.4f} ({d['min']:+.4f} to {d['max']:+.4f})" if d else "—"  # noqa: E731
            best = arm.get("best_ce_at_no_more_flops")
            within = f" (CE within {best['epochs']:.3g} epochs)" if best else ""
            flops = diff(arm.get("minus_ce_equal_flops")) + within
            tm = format_multiplier(arm["token_multiplier"]) if "token_multiplier" in arm else "—"
            cloze = f"{arm['cloze_acc']['mean']:.3f}" if "cloze_acc" in arm else "—"
            mark = " (frontier)" if budget.get("frontier", {}).get("arm") == name else ""
            lines.append(f"| {e} | {name}{mark} | {format_tokens(arm['tokens'])} | {final['mean']:.4f} ± "
                         f"{final['std']:.4f} | {seeds} | {format_flops(arm['flops']['total'])} | "
                         f"{diff(arm.get('minus_frontier_equal_tokens')) if not arm['is_ce'] else '—'} | "
                         f"{flops if not arm['is_ce'] else '—'} | {tm} | {cloze} |")
    return ("\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in summary_lines(results)) + "\n"
            + splits_table(results))


def splits_table(results: dict) -> str:
    """Held-out CE on every split the runs scored, with the teacher's own CE on each (the in-process study)."""
    teacher = results.get("setup", {}).get("teacher_heldout_ce_by_split")
    if not teacher:
        return ""
    first, others = list(teacher)[0], list(teacher)[1:]
    keys = ["final_heldout_ce", *(f"final_heldout_ce_{name}" for name in others)]
    lines = ["", "Held-out CE on each split, mean ± std over seeds (the teacher's own CE on the first row):", "",
             "| E | arm | " + " | ".join(teacher) + " |", "|---|---|" + "---|" * len(teacher),
             "| — | teacher | " + " | ".join(f"{v:.4f}" for v in teacher.values()) + " |"]
    for e, budget in results["epochs"].items():
        for name, arm in budget["arms"].items():
            cells = [f"{arm[k]['mean']:.4f} ± {arm[k]['std']:.4f}" if k in arm else "—" for k in keys]
            lines.append(f"| {e} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n`{first}` is the config's held-out split; the others are scored beside it.\n"


def summary_lines(results: dict) -> list[str]:
    wall, lines = results.get("wall", {}), []
    if wall:
        lines.append(f"CE frontier: lowest at E={wall['best_epochs']} ({wall['best_heldout_ce']:.4f}); at "
                     f"E={wall['largest_epochs']} {wall['at_largest']:.4f}: "
                     + ("it had stopped improving (the data wall)." if wall["stopped_improving"] else
                        "still improving: no wall yet at this U (shrink --unique-tokens)."))
    largest = max((int(e) for e in results["epochs"]), default=0)
    for name, cross in results.get("crossings", {}).items():
        for key, words in (("equal_tokens", "at equal tokens"), ("equal_flops", "at equal FLOPs (teacher once)")):
            c = cross[key]
            text = (f"KD minus CE {c['mean']:+.4f} nats from E={c['epochs']} (paired seeds {c['min']:+.4f} to "
                    f"{c['max']:+.4f})" if c else "never below the CE frontier at these budgets")
            if c and key == "equal_flops":
                arm = results["epochs"][str(c["epochs"])]["arms"][name]
                if arm["ce_epochs_at_equal_flops"] > largest and not results.get("wall", {}).get("stopped_improving"):
                    text += (f"; provisional: its FLOPs buy CE-only {arm['ce_epochs_at_equal_flops']:.3g} epochs, "
                             f"measured up to {largest} on a CE curve still improving")
            lines.append(f"{name} {words}: {text}.")
    return lines


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, flop_ax) = plt.subplots(1, 2, figsize=(13, 5))
    names = sorted({n for b in results["epochs"].values() for n in b["arms"]}, key=list(COLORS).index)
    for name in names:
        points = [(int(e), b["arms"][name]) for e, b in results["epochs"].items() if name in b["arms"]]
        x = [e for e, _ in points]
        mean = [a["final_heldout_ce"]["mean"] for _, a in points]
        low, high = [a["final_heldout_ce"]["min"] for _, a in points], [a["final_heldout_ce"]["max"] for _, a in points]
        style = dict(color=COLORS.get(name), marker="o", linestyle="-" if points[0][1]["is_ce"] else "--")
        ax.plot(x, mean, label=name, **style)
        ax.fill_between(x, low, high, alpha=0.2, color=COLORS.get(name))
        flop_ax.plot([a["flops"]["total"] for _, a in points], mean, label=name, **style)
    frontier = [(int(e), b["frontier"]["mean"]) for e, b in results["epochs"].items() if "frontier" in b]
    if frontier:
        ax.plot(*zip(*frontier), color="black", linewidth=1, alpha=0.6, label="CE frontier (best weight decay)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"epochs over U = {format_tokens(results['setup']['unique_tokens'])} unique tokens")
    flop_ax.set_xscale("log")
    flop_ax.set_xlabel("total training FLOPs: student + the cache's teacher forward over U, once (log)")
    for axis in (ax, flop_ax):
        axis.set_ylabel("final held-out CE (nats/token)")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    ax.set_title("held-out CE vs epochs (band: min-max over seeds)", fontsize=9)
    flop_ax.set_title("held-out CE vs total FLOPs", fontsize=9)
    fig.tight_layout()
    path = out / "kd_wall.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(options, args, runs: list, finished: list, cache_root: Path, cache_names: list[str], out: Path,
           extra: Optional[dict] = None) -> dict:
    """results.json, table.md and kd_wall.png from the finished runs on disk; `extra` joins `setup`."""
    started = time.perf_counter()
    tokens_per_step = args.grad_acc_steps * args.data.batch_size * args.data.seq_len
    epochs = collect_wall(finished, tokens_per_step)
    student = student_flops_per_token(args)
    teacher = teacher_flops_per_token(args.distillation.teacher_path, args.data.seq_len)
    add_frontier(epochs)
    add_flops(epochs, student["train_per_token"], teacher["forward_per_token"], options.unique_tokens)
    crossings = compare(epochs)
    caches = {}
    for name in cache_names:
        cache_dir = cache_dir_of(cache_root, name)
        if cache_is_complete(cache_dir):
            record = build_record_path(cache_dir)
            manifest = CacheManifest.read(cache_dir)
            caches[name] = {"dir": str(cache_dir), "tokens": manifest.sequences_per_stream * manifest.data["seq_len"],
                            "build_s": json.loads(record.read_text())["wall_s"] if record.is_file() else None,
                            "teacher_heldout_ce": teacher_heldout_ce(cache_dir)}
    walls = [s["wall_s"] for b in epochs.values() for a in b["arms"].values() for s in a["seeds"].values()
             if s.get("wall_s")]
    results = {
        "mode": "data_wall",
        "setup": {"config": options.config, "overrides": list(options.overrides),
                  "unique_tokens": options.unique_tokens, "steps_per_epoch": options.unique_tokens // tokens_per_step,
                  "epochs": sorted({r.epochs for r in runs}), "seeds": options.wall_seeds,
                  "end_seeds": options.wall_end_seeds, "parallel": options.parallel,
                  "student": {k: getattr(args.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads")},
                  "teacher": args.distillation.teacher_path,
                  "schedule": "a separate run per (arm, E, seed): the config's cosine over its own E x U tokens, "
                              "warmup a tenth of its steps; one held-out eval at its end", **(extra or {})},
        "teacher_heldout_ce": next((c["teacher_heldout_ce"] for c in caches.values()
                                    if c["teacher_heldout_ce"] is not None), None),
        "compute": {"student": student, "teacher": teacher,
                    "counted": "student 6N+12LDS per trained token over E x U; KD adds the cache's teacher forward "
                               "2N+4LDS per token over U, once (one run reading it); evals not counted"},
        "caches": caches, "epochs": epochs, "crossings": crossings, "wall": wall_of(epochs),
        "runs_wall_s": sum(walls), "report_s": time.perf_counter() - started, "finished": now_iso(),
    }
    missing = [f"{r.arm} E={r.epochs} seed {r.seed}" for r in runs if r not in finished]
    if missing:
        results["missing_runs"] = missing
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    png = plot(results, out) if epochs else None
    print(table(results))
    print(f"results: {out / 'results.json'}, plot: {png}, table: {out / 'table.md'}")
    return results
