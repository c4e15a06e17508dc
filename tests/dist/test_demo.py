"""The README's first command, shortened: `bash setup/demo.sh steps=4 ...` with the real SmolLM2 teacher.

Same entry point as the README (only the environment step is skipped, since the tests already run
inside it, and the data goes to a temporary DATA_DIR). Then the student it wrote is exported to a
transformers LlamaForCausalLM and generates text there, and our sampler reads the checkpoint too.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.runs import ROOT

pytestmark = pytest.mark.slow  # setup/demo.sh with the real SmolLM2 teacher, then python processes

STEPS = 4


@pytest.fixture(scope="module")
def demo_run(smollm2_teacher, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("demo_data")
    (data_dir / "teachers").mkdir()
    # The teacher converted once for the session; prepare_teacher sees it complete and skips it.
    (data_dir / "teachers" / "smollm2-135m-instruct").symlink_to(smollm2_teacher)
    dump_dir = tmp_path_factory.mktemp("demo") / "run"
    env = dict(os.environ, SKIP_ENV="1", VENV=sys.prefix, DATA_DIR=str(data_dir), WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    cmd = ["bash", "setup/demo.sh", f"steps={STEPS}", "logging.freq=2", "data.batch_size=2", f"dump_dir={dump_dir}"]
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"HANG: the demo did not finish within 420s\n{(err.stdout or '')[-6000:]}")
    return result, dump_dir, data_dir


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
    assert f"outputs: {dump_dir}" in out
    assert "[demo] done in" in out

    rows = [json.loads(l) for l in (dump_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in rows if "loss/ce" in r]
    assert [r["step"] for r in train] == [2, 4]
    for key in ("loss/kd", "loss/total", "kd/teacher_mass", "kd/top1_agreement", "kd/bytes_down"):
        assert all(key in r for r in train), (key, train[-1].keys())
    assert train[-1]["loss/ce"] == pytest.approx(ce, abs=1e-4)

    assert (data_dir / "corpus" / "pydocs").is_dir()  # the embedded corpus, written by the demo
    config = json.loads((dump_dir / "checkpoints" / f"{STEPS:010d}" / "params.json").read_text())
    assert config["data"]["tokenizer"]["path"] == str(data_dir / "teachers" / "smollm2-135m-instruct")
    plot = dump_dir / "plot.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_demo_student_exports_to_transformers_and_generates(demo_run, tmp_path):
    result, dump_dir, _ = demo_run
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    exported = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "apps.main.export_hf", f"ckpt={dump_dir / 'checkpoints'}",
                    f"out={exported}"], cwd=ROOT, check=True, capture_output=True, timeout=180)
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
                             cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.strip().startswith("The Python language")
