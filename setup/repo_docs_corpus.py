"""A held-out split the teacher cannot have seen: this repository's own docs and docstrings, written in 2026.

    python -m setup.repo_docs_corpus --out data/corpus          # install the frozen snapshot (prepare_corpus does)
    python -m setup.repo_docs_corpus --snapshot setup/data/repodocs.v2.val.jsonl   # freeze a new version

SmolLM2's training data ends before this project existed, so its CE here is free of contamination, unlike the
`pydocs` split (CPython's docstrings and `help()` topics, which public crawls carry). The split is frozen as a
committed snapshot (`setup/data/repodocs.v<N>.val.jsonl`, versioned by its name and checked by its sha256):
installing it copies those bytes to `<out>/repodocs/repodocs.val.jsonl`, so every study reads the same text
whatever the working tree holds now. It is held out only: no training reads it (the `repodocs` source has no
`*.chunk.*.jsonl`), and a config reads it with `data.eval_sources=[repodocs]`.

Split by file: a file is one document (a markdown page, or a Python module's docstrings in order, each under its
qualified name); the files, shuffled with a fixed seed, are taken whole until they hold `MIN_CHARS` characters.
"""

import argparse
import ast
import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Optional

from lingua.cli.entry import run_cli
from lingua.errors import DataError
from setup.atomic_dir import atomic_output_dir

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_NAME = "repodocs"
VERSION = 1
SNAPSHOT = REPO_ROOT / "setup" / "data" / f"{SOURCE_NAME}.v{VERSION}.val.jsonl"
SNAPSHOT_SHA256 = "7d3529481cd8de87ffa0435eba4baff3a40ce75199df93beb65af3b94c94da13"
MARKER_NAME = "corpus_ready.json"
MIN_CHARS = 150_000  # as the pydocs split: ~40k SmolLM2 tokens
SHUFFLE_SEED = 2026
SOURCE_GLOBS = ("README.md", "docs/**/*.md", "lingua/**/*.py", "apps/**/*.py", "setup/**/*.py")


def module_docstrings(path: Path, root: Path) -> str:
    """A Python file's docstrings (module, classes, functions, methods) in source order, each under its name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    parts = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child)
                if doc:
                    parts.append(f"{prefix}{child.name}\n\n{doc}")
                visit(child, f"{prefix}{child.name}.")

    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"Module {module}\n\n{doc}")
    visit(tree, f"{module}.")
    return "\n\n".join(parts)


def collect_repo_docs(root: Path = REPO_ROOT) -> list[dict]:
    """Every file's document ({"file", "text"}), sorted by path; files without text are left out."""
    paths = sorted({p for pattern in SOURCE_GLOBS for p in root.glob(pattern) if p.is_file()})
    docs = []
    for path in paths:
        text = (path.read_text(encoding="utf-8").strip() if path.suffix == ".md"
                else module_docstrings(path, root))
        if text:
            docs.append({"file": str(path.relative_to(root)), "text": text})
    return docs


def held_out_files(docs: list[dict], min_chars: int = MIN_CHARS) -> list[dict]:
    """Whole files in a fixed shuffled order until they hold `min_chars` characters."""
    order = list(docs)
    random.Random(SHUFFLE_SEED).shuffle(order)
    chosen, chars = [], 0
    for doc in order:
        if chars >= min_chars:
            break
        chosen.append(doc)
        chars += len(doc["text"])
    if chars < min_chars:
        raise DataError(f"the repository's docs hold only {chars:,} characters, fewer than {min_chars:,}; run this "
                        f"from a full checkout of the repository.")
    return chosen


def write_snapshot(path: Path, root: Path = REPO_ROOT) -> str:
    """Freeze the split from the working tree into `path` (one {"text", "file"} per line); returns its sha256."""
    lines = "".join(json.dumps({"text": d["text"], "file": d["file"]}, ensure_ascii=False) + "\n"
                    for d in held_out_files(collect_repo_docs(root)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(lines, encoding="utf-8")
    tmp.replace(path)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def snapshot_problem(snapshot: Path = SNAPSHOT, sha256: str = SNAPSHOT_SHA256) -> Optional[str]:
    if not snapshot.is_file():
        return f"{snapshot} is missing; restore it from git (git checkout -- {snapshot.relative_to(REPO_ROOT)})"
    digest = hashlib.sha256(snapshot.read_bytes()).hexdigest()
    if digest != sha256:
        return (f"{snapshot} has sha256 {digest[:12]}..., not the frozen {sha256[:12]}...; restore it from git, or "
                f"freeze a new version (--snapshot) and bump VERSION")
    return None


def prepare_repo_docs(out_dir, snapshot: Path = SNAPSHOT, sha256: str = SNAPSHOT_SHA256) -> Path:
    """Install the frozen split as `<out_dir>/repodocs/repodocs.val.jsonl` (skipped when that version is there)."""
    source_dir = Path(out_dir) / SOURCE_NAME
    marker = source_dir / MARKER_NAME
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == sha256 \
            and (source_dir / f"{SOURCE_NAME}.val.jsonl").is_file():
        logger.info("post-cutoff split already in %s", source_dir)
        return source_dir
    problem = snapshot_problem(snapshot, sha256)
    if problem is not None:
        raise DataError(f"The post-cutoff held-out split cannot be installed: {problem}.")
    data = snapshot.read_bytes()
    lines = data.decode("utf-8").splitlines()
    with atomic_output_dir(source_dir) as tmp_dir:
        (tmp_dir / f"{SOURCE_NAME}.val.jsonl").write_bytes(data)
        stats = {"version": VERSION, "sha256": sha256, "n_val_docs": len(lines),
                 "val_chars": sum(len(json.loads(line)["text"]) for line in lines),
                 "files": [json.loads(line)["file"] for line in lines]}
        (tmp_dir / MARKER_NAME).write_text(json.dumps(stats, indent=2) + "\n")
    logger.info("wrote the post-cutoff split (%d files, %d chars) to %s", stats["n_val_docs"], stats["val_chars"],
                source_dir)
    return source_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/corpus", help="corpus root (the data.root_dir of a config)")
    parser.add_argument("--snapshot", default=None, help="freeze the working tree's split into this file instead")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.snapshot:
        print(f"{args.snapshot}: sha256 {write_snapshot(Path(args.snapshot))} (set SNAPSHOT_SHA256 and VERSION)")
        return
    print(f"post-cutoff held-out split: {prepare_repo_docs(args.out)}")


if __name__ == "__main__":
    run_cli(main)
