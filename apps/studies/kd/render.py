"""The study rendered: kd_study.png (held-out CE vs tokens and vs FLOPs, finals per seed) and table.md."""

import math
import statistics
from pathlib import Path

from apps.studies.kd.arms import ARMS
from apps.studies.kd.results import curve_flops, paired_difference


COLORS = {"ce": "#6baed6", "ce_2x": "#2171b5", "ce_4x": "#08306b", "kd_topk64": "tab:orange",
          "kd_topk64_lr": "tab:red", "kd_sampled64": "tab:green"}


def mean_curve(arm: dict) -> tuple[list[float], list[float], list[float], list[float]]:
    curves = [seed["heldout"] for seed in arm["seeds"].values()]
    n = min(len(c) for c in curves)
    tokens = [curves[0][i]["tokens"] for i in range(n)]
    losses = [[curve[i]["heldout_ce"] for curve in curves] for i in range(n)]
    return tokens, [statistics.fmean(v) for v in losses], [min(v) for v in losses], [max(v) for v in losses]


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, flop_ax, final_ax) = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [2, 2, 1.2]})
    arms = results["arms"]
    names = list(arms)
    teacher = results.get("teacher_heldout_ce")
    for name, arm in arms.items():
        tokens, mean, low, high = mean_curve(arm)
        color = COLORS.get(name)
        is_ce = name in ARMS and ARMS[name].is_ce
        # CE budgets share their early tokens' region: the smaller budget is drawn on top.
        style = dict(linestyle="-" if is_ce else "--", zorder=3 - math.log2(ARMS[name].multiple) / 4 if is_ce else 3)
        line, = ax.plot(tokens, mean, marker="o", markersize=3, color=color, label=f"{name} ({len(arm['seeds'])} seeds)",
                        **style)
        ax.fill_between(tokens, low, high, alpha=0.2, color=line.get_color())
        if results.get("compute"):
            modes = ["cache", "online"] if name in ARMS and ARMS[name].cache else ["cache"]
            for mode in modes:
                x = [curve_flops(name, t, results, mode) for t in tokens]
                label = name if mode == "cache" else f"{name}, online teacher"
                flop_ax.plot(x, mean, marker="o" if mode == "cache" else "x", markersize=3, color=line.get_color(),
                             linestyle="-" if mode == "cache" else ":", label=label, zorder=style["zorder"])
    # The CE-only budgets' finals (the curve the token multiplier interpolates on) and where each KD arm lands.
    ce_points = sorted((arm["tokens"], arm["final_heldout_ce"]["mean"]) for name, arm in arms.items()
                       if name in ARMS and ARMS[name].is_ce)
    if len(ce_points) > 1:
        ax.plot(*zip(*ce_points), color="black", linewidth=1, marker="D", markersize=4, alpha=0.7,
                label="CE-only finals per budget")
    for name, arm in arms.items():
        multiplier = arm.get("token_multiplier", {}).get("mean")
        if multiplier is not None:
            ax.plot([arm["tokens"], multiplier * arm["tokens"]], [arm["final_heldout_ce"]["mean"]] * 2,
                    color=COLORS.get(name, "gray"), linewidth=0.8, linestyle=":")
            ax.plot(multiplier * arm["tokens"], arm["final_heldout_ce"]["mean"], marker="*", markersize=10,
                    color=COLORS.get(name, "gray"))
    if teacher is not None:  # on the tokens panel only: the FLOPs panel keeps its y-axis on the students
        ax.axhline(teacher, color="black", linestyle="--", linewidth=1,
                   label=f"teacher ({Path(results['setup']['teacher']).name}) {teacher:.2f}")
    for axis in (ax, flop_ax):
        axis.set_xscale("log")
        axis.set_ylabel("held-out CE (nats/token)")
        axis.grid(alpha=0.3, which="both")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    ax.set_xlabel("training tokens (log)")
    ax.set_title("held-out CE vs tokens (band: min-max over seeds; *: KD = CE-only at N tokens)", fontsize=9)
    flop_ax.set_xlabel("total training FLOPs, student + teacher (log)")
    flop_ax.set_title("held-out CE vs training FLOPs (solid: teacher cache, its cost shared by the runs reading "
                      "it; dotted: online teacher)", fontsize=8)
    # Right: each seed's final held-out CE per arm, a seed's arms joined (they share init and data order).
    seeds = sorted({s for arm in arms.values() for s in arm["seeds"]}, key=int)
    for seed in seeds:
        points = [(i, arm["seeds"][seed]["final_heldout_ce"]) for i, arm in enumerate(arms.values())
                  if seed in arm["seeds"]]
        final_ax.plot(*zip(*points), marker="o", color="gray", alpha=0.6, linewidth=0.8)
    final_ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8, ha="right")
    final_ax.set_xlim(-0.5, len(names) - 0.5)
    final_ax.set_title("final held-out CE per seed", fontsize=9)
    final_ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "kd_study.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_tokens(tokens: float) -> str:
    if tokens >= 1e6:
        return f"{tokens / 1e6:.2f}M"
    if tokens >= 1e5:
        return f"{tokens / 1e3:.0f}k"
    return f"{tokens / 1e3:.1f}k" if tokens >= 1e3 else f"{tokens:.0f}"


def format_multiplier(tm: dict) -> str:
    """'1.83x (1.71-1.95)'; bounds as '>4x' / '<=1x' (with the count of seeds when they are mixed)."""
    per_seed = list(tm["per_seed"].values())
    n = len(per_seed)
    parts = []
    if tm["mean"] is not None:
        count = sum(v["value"] is not None for v in per_seed)
        parts.append(f"{tm['mean']:.2f}x ({tm['min']:.2f}-{tm['max']:.2f})" + (f" on {count}/{n} seeds" if count < n else ""))
    for key, sign in (("at_least", ">"), ("at_most", "<")):
        bounds = [v[key] for v in per_seed if key in v]
        if bounds:
            parts.append(f"{sign}{max(bounds) if key == 'at_least' else min(bounds):g}x" + (f" on {len(bounds)}/{n} seeds" if len(bounds) < n else ""))
    return "; ".join(parts)


def format_flops(value: float) -> str:
    return f"{value:.2e}" if value else "0"


def table(results: dict) -> str:
    arms = results["arms"]
    lines = ["| arm | settings | tokens | final held-out CE, mean ± std | per seed | minus CE-only (1x), paired by seed "
             "| = CE-only tokens (x of its own) | pydocs_cloze acc, mean (per seed) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        final = arm["final_heldout_ce"]
        seeds = ", ".join(f"{seed['final_heldout_ce']:.4f}" for seed in arm["seeds"].values())
        paired = arm.get("minus_ce_paired")
        diff = (f"{paired['mean']:+.4f} ({paired['min']:+.4f} to {paired['max']:+.4f})" if paired else "—")
        settings = " ".join(o.replace("distillation.", "") for o in arm["overrides"])
        if arm.get("steps") and arm.get("multiple", 1) != 1:
            settings += f" steps={arm['steps']}"
        tm = arm.get("token_multiplier")
        worth = "—"
        if tm is not None:
            worth = format_multiplier(tm)
            if arm.get("ce_tokens_equivalent"):
                worth = f"{format_tokens(arm['ce_tokens_equivalent'])}: {worth}"
        accs = [seed.get("cloze_acc") for seed in arm["seeds"].values()]
        cloze = (f"{arm['cloze_acc']['mean']:.3f} ({', '.join(f'{a:.3f}' for a in accs if a is not None)})"
                 if "cloze_acc" in arm else "—")
        lines.append(f"| {name} | {settings} | {format_tokens(arm['tokens'])} | {final['mean']:.4f} ± {final['std']:.4f} "
                     f"| {seeds} | {diff} | {worth} | {cloze} |")
    teacher = results.get("teacher_heldout_ce")
    if teacher is not None:
        lines.append(f"| teacher | {Path(results['setup']['teacher']).name} | | {teacher:.4f} | | | | |")
    if any("flops" in arm for arm in arms.values()):
        lines += ["", "Compute (training FLOPs per run; held-out evals not counted):", "",
                  "| arm | student | teacher, online | teacher, cache (amortized) | total, online KD | total, from the cache "
                  "| final held-out CE |", "|---|---|---|---|---|---|---|"]
        for name, arm in arms.items():
            f = arm["flops"]
            cache = results.get("caches", {}).get(ARMS[name].cache) if name in ARMS and ARMS[name].cache else None
            share = (f"{format_flops(f['teacher_cache_amortized'])} (1/{cache['runs_reading']} of "
                     f"{format_flops(cache['teacher_flops'])})" if cache else "0")
            lines.append(f"| {name} | {format_flops(f['student'])} | {format_flops(f['teacher_online'])} | {share} "
                         f"| {format_flops(f['total_online'])} | {format_flops(f['total_cache'])} "
                         f"| {arm['final_heldout_ce']['mean']:.4f} |")
    summary = summary_lines(results)
    if summary:
        lines += [""] + [f"- {line}" for line in summary]
    return "\n".join(lines) + "\n"


def summary_lines(results: dict) -> list[str]:
    arms, lines = results["arms"], []
    for name, arm in arms.items():
        tm = arm.get("token_multiplier")
        if tm is None:
            continue
        if tm["mean"] is not None and all(v["value"] is not None for v in tm["per_seed"].values()):
            per_seed = ", ".join(f"{v['value']:.2f}" for v in tm["per_seed"].values())
            lines.append(f"{name} at {format_tokens(arm['tokens'])} tokens = CE-only at "
                         f"{format_tokens(arm['ce_tokens_equivalent'])} tokens ({tm['mean']:.2f}x, per seed {per_seed}).")
        else:
            lines.append(f"{name} at {format_tokens(arm['tokens'])} tokens = CE-only at {format_multiplier(tm)} its tokens.")
    if "kd_sampled64" in arms and "kd_topk64" in arms:
        d = paired_difference(arms["kd_sampled64"], arms["kd_topk64"])
        if d is not None:
            lines.append(f"kd_sampled64 minus kd_topk64, paired by seed: {d['mean']:+.4f} ({d['min']:+.4f} to "
                         f"{d['max']:+.4f}) nats.")
    decision = results.get("setup", {}).get("ce_4x")
    if decision is not None and not decision.get("ran"):
        lines.append(f"ce_4x not run: {decision['reason']}.")
    return lines
