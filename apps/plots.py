"""Plot training curves of one or more runs from their metrics.jsonl files.

    python -m apps.plots dumps/kd_on dumps/kd_off --labels "KD on" "KD off" --out kd_vs_ce.png

Panels (each drawn only when some run has its keys): losses (loss/total, loss/ce, loss/kd),
KD agreement (kd/top1_agreement, kd/teacher_mass), throughput (speed/tokens_per_s), eval loss.
"""

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

from lingua.errors import DataError, MissingPathError, UserError  # noqa: E402
from lingua.run.dump_dir import read_jsonl  # noqa: E402

logger = logging.getLogger(__name__)

# (panel title, y label, [(metric key, line style)]); a run's colour is the same in every panel.
PANELS = (
    ("Training loss", "loss", [("loss/total", "-"), ("loss/ce", "--"), ("loss/kd", ":")]),
    ("Agreement with the teacher", "fraction", [("kd/top1_agreement", "-"), ("kd/teacher_mass", "--")]),
    ("Throughput", "tokens / s", [("speed/tokens_per_s", "-")]),
    ("Eval loss", "loss", [("eval/loss", "-")]),
    ("Eval bits per byte (compares tokenizers)", "bits / byte", [("eval/bpb", "-")]),
)


def metrics_file(path: str) -> Path:
    """`path` itself if it is a file, else `path/metrics.jsonl`; readable error when missing."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "metrics.jsonl"
    if not candidate.is_file():
        raise MissingPathError(f"{candidate} does not exist; pass a dump dir that holds metrics.jsonl "
                               f"or the path of a metrics.jsonl file.")
    return candidate


def load_metrics(path: str) -> list[dict]:
    """The JSON rows of a dump dir's metrics.jsonl (a torn last line from a crash is skipped)."""
    file = metrics_file(path)
    rows = read_jsonl(file)
    if not rows:
        raise DataError(f"{file} holds no metrics yet; plot a run that has logged at least one step.")
    return rows


def series(rows: list[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    """(x, y) for every row that has both keys; a restart that re-logs a step keeps the newest value."""
    by_x: dict[float, float] = {}
    for row in rows:
        if key in row and x_key in row and row[key] is not None:
            by_x[row[x_key]] = row[key]
    xs = sorted(by_x)
    return xs, [by_x[x] for x in xs]


def panels_with_data(runs: list[tuple[str, list[dict]]], x_key: str = "step") -> list[tuple]:
    """The PANELS that have data for at least one of `runs` ((label, rows) pairs)."""
    return [panel for panel in PANELS if any(series(rows, key, x_key)[0] for _, rows in runs for key, _ in panel[2])]


def plot_runs(runs: list[tuple[str, list[dict]]], out: str, x_key: str = "step") -> Path:
    """Draw every panel that has data for at least one of `runs` ((label, rows) pairs) into `out`."""
    panels = panels_with_data(runs, x_key)
    if not panels:
        raise DataError(f"none of the runs has any of the plotted metrics against {x_key!r}; "
                        f"check that the files are training metrics.jsonl files.")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, (title, y_label, keys) in zip(axes[:, 0], panels):
        for run_index, (label, rows) in enumerate(runs):
            for key, style in keys:
                xs, ys = series(rows, key, x_key)
                if xs:
                    ax.plot(xs, ys, linestyle=style, color=colors[run_index % len(colors)],
                            label=f"{label}: {key}" if len(runs) > 1 else key)
        ax.set_title(title)
        ax.set_xlabel(x_key)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def default_label(path: str) -> str:
    """The dump dir's name (for a metrics.jsonl path, its folder's name)."""
    candidate = Path(path).resolve()
    return candidate.parent.name if candidate.is_file() else candidate.name


def main(argv: Optional[list[str]] = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m apps.plots", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="dump dirs or metrics.jsonl files, one per run")
    parser.add_argument("--out", help="PNG to write (default: <first dump dir>/plot.png)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: dump dir names)")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="x axis")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.paths):
        parser.error(f"got {len(args.labels)} labels for {len(args.paths)} runs; give one label per path.")
    labels = args.labels or [default_label(path) for path in args.paths]
    try:
        runs = [(label, load_metrics(path)) for label, path in zip(labels, args.paths)]
        out = args.out or str(metrics_file(args.paths[0]).parent / "plot.png")
        out_path = plot_runs(runs, out, x_key=args.x)
    except UserError as error:
        parser.error(str(error))
    print(f"wrote {out_path}")
    return out_path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main()
