"""An English corpus that needs no download: the documentation every Python installation carries.

    python -m setup.prepare_corpus --out data/corpus --n-chunks 4

Sources, in a fixed order: the language reference topics behind `help()` (`pydoc_data.topics`) and the
docstrings of a fixed list of standard-library modules (module, class, function and method docs).
Writes our data layout, `<out>/pydocs/pydocs.chunk.<i>.jsonl` plus a held-out `pydocs.val.jsonl`
(whole documents, at least VAL_MIN_CHARS characters: ~38k SmolLM2 tokens, none of them in training),
one `{"text": ...}` per line. Same Python version -> byte-identical files. Public crawls carry CPython's
docs, so a teacher may have trained on the held-out split; `<out>/repodocs/repodocs.val.jsonl`, installed
beside it (setup/repo_docs_corpus.py), is a second held-out split written after the teacher's cutoff.
"""

import argparse
import hashlib
import importlib
import inspect
import json
import logging
import os
import pkgutil
import random
import subprocess
import sys
import warnings
from pathlib import Path

from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError
from setup.atomic_dir import atomic_output_dir
from setup.repo_docs_corpus import prepare_repo_docs

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]

SOURCE_NAME = "pydocs"
MARKER_NAME = "corpus_ready.json"
# Bumped whenever the files' content changes, so an existing corpus directory is rebuilt.
CORPUS_VERSION = 2
MIN_DOC_CHARS = 200
# Held out: whole documents from the front of the shuffled list until they hold this many characters.
# SmolLM2's tokenizer reads this corpus at ~4.0 chars per token, so that is ~37k tokens: enough for a
# perplexity that moves by well under 1% when a few documents change (the test checks >= 30k tokens).
VAL_MIN_CHARS = 150_000
SHUFFLE_SEED = 1234

# Pure-Python, side-effect-free stdlib packages/modules with substantial English docstrings.
# Packages also contribute their public submodules.
STDLIB_MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "builtins", "calendar", "cmd",
    "code", "codecs", "codeop", "collections", "colorsys", "compileall", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "ctypes", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "doctest", "email", "enum", "filecmp", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq",
    "hmac", "html", "http", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools",
    "json", "linecache", "locale", "logging", "lzma", "mailbox", "math", "mimetypes",
    "modulefinder", "multiprocessing", "netrc", "numbers", "operator", "optparse", "os", "pathlib",
    "pdb", "pickle", "pickletools", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue",
    "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "selectors", "shelve",
    "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat",
    "statistics", "string", "struct", "subprocess", "symtable", "sys", "sysconfig", "tabnanny",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "tomllib", "trace",
    "traceback", "types", "typing", "unittest", "urllib", "uuid", "warnings", "wave", "weakref",
    "wsgiref", "xml", "xmlrpc", "zipapp", "zipfile", "zipimport", "zoneinfo",
]


def _public_submodules(package) -> list[str]:
    """Names of a package's public submodules, recursively, sorted; tests and private modules skipped."""
    if not hasattr(package, "__path__"):
        return []
    names = []
    for info in pkgutil.iter_modules(package.__path__, prefix=package.__name__ + "."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf.startswith("_") or leaf.startswith("test") or leaf == "__main__":
            continue
        names.append(info.name)
        if info.ispkg:
            try:
                names.extend(_public_submodules(importlib.import_module(info.name)))
            except Exception:  # platform-specific subpackages (e.g. Windows-only) just don't count
                continue
    return sorted(names)


def _module_docs(module) -> list[str]:
    """Docstrings of a module and of the classes, functions and methods it defines, each titled by its name."""
    docs = []

    def add(title: str, obj) -> None:
        doc = inspect.getdoc(obj)
        if doc:
            docs.append(f"{title}\n\n{doc.strip()}")

    add(f"Module {module.__name__}", module)
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            add(f"Class {module.__name__}.{name}", obj)
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") and attr != "__init__":
                    continue
                if inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod, property)):
                    add(f"Method {module.__name__}.{name}.{attr}", getattr(member, "__func__", member))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            add(f"Function {module.__name__}.{name}", obj)
    return docs


def collect_python_docs() -> list[str]:
    """All documents, in a fixed order, deduplicated, without the very short ones."""
    from pydoc_data.topics import topics

    candidates = [f"{name}\n\n{text.strip()}" for name, text in sorted(topics.items())]
    module_names = []
    with warnings.catch_warnings():
        # Some stdlib modules warn about their own deprecation on import; irrelevant here.
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # a Python built without this module (or a later version that dropped it)
                logger.info("skipping stdlib module %s: not importable here", name)
                continue
            module_names.append(name)
            module_names.extend(_public_submodules(module))
        for name in module_names:
            try:
                module = importlib.import_module(name)
            except Exception:  # a submodule needing an absent optional dependency or another OS
                continue
            candidates.extend(_module_docs(module))

    seen, docs = set(), []
    for text in candidates:
        # Titles differ for re-exported objects; the body is what must not repeat.
        body_key = hashlib.sha1(text.split("\n\n", 1)[-1].encode()).hexdigest()
        if len(text) < MIN_DOC_CHARS or body_key in seen:
            continue
        seen.add(body_key)
        docs.append(text)
    return docs


def _collect_in_fresh_interpreter() -> list[str]:
    """`collect_python_docs()` run in a new interpreter, so the caller's state cannot leak into the corpus.

    A caller may have replaced stdlib functions (pytest swaps `sys.unraisablehook`) or imported modules
    that patch others; any of that would change which docstrings exist and so the whole shuffle.
    """
    code = "import json, sys; from setup.prepare_corpus import collect_python_docs as c; json.dump(c(), sys.stdout)"
    python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": python_path}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"collecting the docs failed:\n{result.stderr}"
    return json.loads(result.stdout)


def _is_complete(source_dir: Path, n_chunks: int) -> bool:
    marker = source_dir / MARKER_NAME
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    expected = [f"{SOURCE_NAME}.chunk.{i}.jsonl" for i in range(n_chunks)] + [f"{SOURCE_NAME}.val.jsonl"]
    return (info.get("version") == CORPUS_VERSION and info.get("n_chunks") == n_chunks
            and all((source_dir / name).is_file() for name in expected))


def _write_jsonl(path: Path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def split_held_out(docs: list[str], min_chars: int) -> tuple[list[str], list[str]]:
    """(held-out, train): the first documents until they hold `min_chars`, and the rest; never both."""
    n_val, chars = 0, 0
    while n_val < len(docs) - 1 and chars < min_chars:
        chars += len(docs[n_val])
        n_val += 1
    if chars < min_chars:
        raise DataError(f"the corpus has only {sum(map(len, docs)):,} characters, too few to hold out "
                        f"{min_chars:,}; this Python's docs are incomplete (is pydoc_data installed?).")
    return docs[:n_val], docs[n_val:]


def prepare_python_docs_corpus(out_dir, n_chunks: int = 4, force: bool = False) -> Path:
    """Write the Python-docs corpus under `out_dir/pydocs/` (skipped if already there); return that dir."""
    if n_chunks < 1:
        raise ConfigError(f"n_chunks must be at least 1, got {n_chunks}; pass --n-chunks 1 or more.")
    source_dir = Path(out_dir) / SOURCE_NAME
    if not force and _is_complete(source_dir, n_chunks):
        logger.info("corpus already prepared in %s", source_dir)
        return source_dir

    docs = _collect_in_fresh_interpreter()
    random.Random(SHUFFLE_SEED).shuffle(docs)
    val_docs, train_docs = split_held_out(docs, VAL_MIN_CHARS)
    with atomic_output_dir(source_dir) as tmp_dir:
        for i in range(n_chunks):
            _write_jsonl(tmp_dir / f"{SOURCE_NAME}.chunk.{i}.jsonl", train_docs[i::n_chunks])
        _write_jsonl(tmp_dir / f"{SOURCE_NAME}.val.jsonl", val_docs)
        stats = {
            "version": CORPUS_VERSION,
            "n_chunks": n_chunks,
            "n_train_docs": len(train_docs),
            "n_val_docs": len(val_docs),
            "train_chars": sum(len(t) for t in train_docs),
            "val_chars": sum(len(t) for t in val_docs),
        }
        (tmp_dir / MARKER_NAME).write_text(json.dumps(stats, indent=2) + "\n")
    logger.info(
        "wrote %d train docs (%d chars) in %d chunks and %d val docs (%d chars) to %s",
        stats["n_train_docs"], stats["train_chars"], n_chunks, stats["n_val_docs"], stats["val_chars"], source_dir,
    )
    return source_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/corpus", help="corpus root (the data.root_dir of a config)")
    parser.add_argument("--n-chunks", type=int, default=4, help="number of training chunk files")
    parser.add_argument("--force", action="store_true", help="rebuild even if the corpus is already there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    source_dir = prepare_python_docs_corpus(args.out, n_chunks=args.n_chunks, force=args.force)
    stats = json.loads((source_dir / MARKER_NAME).read_text())
    print(
        f"{source_dir}: {stats['n_train_docs']} train docs / {stats['train_chars']:,} chars in "
        f"{stats['n_chunks']} chunks, {stats['n_val_docs']} val docs / {stats['val_chars']:,} chars"
    )
    post_cutoff = prepare_repo_docs(args.out)
    stats = json.loads((post_cutoff / MARKER_NAME).read_text())
    print(f"{post_cutoff}: {stats['n_val_docs']} held-out files / {stats['val_chars']:,} chars, written after the "
          f"teacher's cutoff (version {stats['version']})")


if __name__ == "__main__":
    run_cli(main)
