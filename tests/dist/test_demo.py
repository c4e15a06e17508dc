"""README.md's first command (the demo) and its Quickstart, run as printed from a fresh copy of the repository.

The copy is `git archive HEAD` in a temporary folder, sharing this venv as its `.venv` (a symlink) and SmolLM2
converted once for the session (a symlink at data/teachers/smollm2-135m-instruct, which `setup.prepare_teacher`
finds complete and skips). The commands run in order, each block in one `bash -e`, with no venv on PATH:

1. the first screen's first command, `bash setup/demo.sh`, shortened by DEMO_OVERRIDES (training overrides the
   demo passes on; the only change to a printed command: the full demo is 60 steps, its timing is in
   docs/demo.md). Its second command, the test suite, is the one .ci/run runs (tests/unit/test_docs.py checks it);
   running it here would run this test again;
2. every block of the Quickstart, exactly as printed.

Then the student the demo wrote is exported to a transformers LlamaForCausalLM and generates text there, and our
sampler reads the checkpoint too.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lingua.run.dump_dir import read_metrics, train_rows
from tests.readme import DEMO_COMMAND, TEST_COMMAND, commands, readme_blocks
from tests.runs import ROOT

pytestmark = pytest.mark.slow  # setup/demo.sh with the real SmolLM2 teacher, then torchrun and python processes

STEPS = 4
DEMO_OVERRIDES = [f"steps={STEPS}", "logging.freq=2", "data.batch_size=2"]
DEMO_DUMP = Path("dumps/smollm2_cpu_demo")  # configs/distill_exps/smollm2_cpu.yaml's dump_dir


def clean_env() -> dict:
    """The environment of a user's shell: no venv on PATH, nothing imported from this checkout."""
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return dict(env, PATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def run_block(block: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["bash", "-e", "-c", block], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"HANG: a README block did not finish within {timeout}s:\n{block}\n"
                             f"{(err.stdout or '')[-4000:]}")


@pytest.fixture(scope="module")
def fresh_copy(smollm2_teacher, tmp_path_factory) -> Path:
    if not (ROOT / ".git").exists():
        pytest.skip("the README's commands run from `git archive HEAD`, and this checkout is not a git repository")
    copy = tmp_path_factory.mktemp("fresh") / "lingua-kd"
    copy.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive.stdout, check=True)
    (copy / ".venv").symlink_to(Path(sys.prefix))
    (copy / "data" / "teachers").mkdir(parents=True)
    (copy / "data" / "teachers" / "smollm2-135m-instruct").symlink_to(smollm2_teacher)
    return copy


@pytest.fixture(scope="module")
def demo_run(fresh_copy):
    (block,) = readme_blocks("first screen")
    assert commands(block) == [DEMO_COMMAND, TEST_COMMAND], block  # the test command is CI's (tests/unit/test_docs.py)
    result = run_block(f"{DEMO_COMMAND} {shlex.join(DEMO_OVERRIDES)}", fresh_copy, timeout=420)
    return result, fresh_copy / DEMO_DUMP, fresh_copy / "data"


@pytest.mark.timeout(480)
def test_demo_trains_with_the_real_teacher_and_prints_the_summary(demo_run):
    result, dump_dir, data_dir = demo_run
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert f"run completed: {STEPS} steps" in out
    final = re.search(r"final CE (\d+\.\d+), KD (\d+\.\d+), teacher-student top-1 agreement (\d\.\d+)", out)
    assert final, out[-4000:]
    ce, kd, agreement = map(float, final.groups())
    assert 0 < ce < 20 and kd > 0 and 0 <= agreement <= 1
    assert re.search(r"time waiting on the teacher: \d+\.\d+s", out)
    assert f"outputs: {DEMO_DUMP}" in out
    assert "[demo] done in" in out

    rows = [json.loads(l) for l in (dump_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in rows if "loss/ce" in r]
    assert [r["step"] for r in train] == [2, 4]
    for key in ("loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "kd/bytes_down"):
        assert all(key in r for r in train), (key, train[-1].keys())
    assert train[-1]["loss/ce"] == pytest.approx(ce, abs=1e-4)

    assert (data_dir / "corpus" / "pydocs").is_dir()  # the embedded corpus, written by the demo
    config = json.loads((dump_dir / "checkpoints" / f"{STEPS:010d}" / "params.json").read_text())
    assert config["data"]["tokenizer"]["path"] == "data/teachers/smollm2-135m-instruct"  # the config's own
    plot = dump_dir / "plot.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_demo_student_exports_to_transformers_and_generates(demo_run, tmp_path):
    result, dump_dir, _ = demo_run
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    exported = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "apps.main.export_hf", f"ckpt={dump_dir / 'checkpoints'}",
                    f"out={exported}"], cwd=dump_dir.parents[1], check=True, capture_output=True, timeout=180)
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = tok('The Python language', return_tensors='pt').input_ids\n"
        "out = model.generate(ids, max_new_tokens=8, do_sample=False)\n"
        "print(type(model).__name__, out.shape[1] - ids.shape[1], repr(tok.decode(out[0])))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code, str(exported)], cwd=ROOT, capture_output=True, text=True,
                            timeout=180, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    name, n_new, text = loaded.stdout.strip().splitlines()[-1].split(" ", 2)
    assert name == "LlamaForCausalLM" and int(n_new) == 8 and text.startswith("'The Python language")

    sampled = subprocess.run([sys.executable, "-m", "apps.main.generate", f"ckpt={dump_dir / 'checkpoints'}",
                              "prompt=The Python language", "max_new_tokens=8", "seed=0"],
                             cwd=dump_dir.parents[1], capture_output=True, text=True, timeout=180)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.strip().startswith("The Python language")


def dump_dir_of(command: str, cwd: Path) -> Path:
    """Where a printed training command writes: its dump_dir= override, else its config's dump_dir."""
    words = shlex.split(command)
    overrides = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    return cwd / (overrides.get("dump_dir") or yaml.safe_load((cwd / overrides["config"]).read_text())["dump_dir"])


@pytest.mark.timeout(600)
def test_the_quickstart_runs_as_printed_after_the_demo(demo_run, fresh_copy):
    """Every Quickstart block in order, in the copy the demo prepared (its corpus): each training command ends with
    exit 0 and writes its own dump dir's metrics (no command reuses a dump dir of another rank count). Then the
    shipped debug_cpu config's run is read as its own test would (logs, held-out evals, checkpoints, save timing)
    and resumed as the README says ("Run the first command again and it resumes (`steps=80` trains on; ...)")."""
    assert demo_run[0].returncode == 0, (demo_run[0].stdout + demo_run[0].stderr)[-3000:]
    blocks = readme_blocks("Quickstart")
    assert blocks, "README.md's Quickstart has no ```bash block"
    trained = []
    for block in blocks:
        result = run_block(block, fresh_copy, timeout=480)
        assert result.returncode == 0, f"{block}\n{(result.stdout + result.stderr)[-5000:]}"
        trained += [dump_dir_of(c, fresh_copy) for c in commands(block) if "-m apps.main.train" in c]
    assert len(trained) == len(set(trained)) >= 2, trained
    for dump_dir in trained:
        assert (dump_dir / "metrics.jsonl").read_text().strip(), dump_dir

    first = commands(blocks[0])[1]  # torchrun --nproc-per-node 2 ... config=configs/debug_cpu.yaml
    dump = dump_dir_of(first, fresh_copy)
    assert dump == fresh_copy / "dumps" / "debug_cpu", first
    check_the_debug_cpu_run(dump, last_step=40)
    resumed = run_block(f"source .venv/bin/activate\n{first} steps=80", fresh_copy, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-5000:]
    assert "resumed from step 40" in resumed.stdout + resumed.stderr
    check_the_debug_cpu_run(dump, last_step=80)


def check_the_debug_cpu_run(dump: Path, last_step: int):
    """configs/debug_cpu.yaml as shipped: a row every 5 steps (logging.freq), the held-out CE and bits per byte
    every 20 (heldout.every), a checkpoint every 20 keeping 2, each save timed apart from its step."""
    rows, every_20 = train_rows(dump), list(range(20, last_step + 1, 20))
    assert sorted(rows) == list(range(5, last_step + 1, 5))
    assert rows[last_step]["loss/ce"] < rows[5]["loss/ce"]
    evals = [r for r in read_metrics(dump) if "eval/loss" in r]
    assert [r["step"] for r in evals] == every_20
    # Bits per byte beside it: the byte tokenizer's EOS targets add CE and no bytes, so at least the CE in bits.
    assert all(math.isfinite(r["eval/bpb"]) and r["eval/bpb"] >= r["eval/loss"] / math.log(2) for r in evals)
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == [f"{step:010d}" for step in every_20[-2:]]
    assert [step for step, row in sorted(rows.items()) if "checkpoint/save_s" in row] == every_20
    assert all(rows[step]["checkpoint/save_s"] > 0 for step in every_20)
    assert (dump / "config.yaml").exists() and "vocab_size: 258" in (dump / "config.yaml").read_text()
