"""Fixtures for the multi-process tests: a small corpus, tiny teachers, and a run-directory factory."""

import json
import random
from pathlib import Path

import pytest

WORDS = ("the model reads tokens and predicts the next one while the teacher sends its top guesses "
         "so that the student learns faster than from labels alone data flows through packed windows "
         "and every rank reads its own shard of the files").split()


def write_corpus(root: Path, n_chunks: int = 3, docs_per_chunk: int = 200, seed: int = 0) -> Path:
    """root/text/text.chunk.<i>.jsonl and a validation file, deterministic."""
    rng = random.Random(seed)
    source = root / "text"
    source.mkdir(parents=True, exist_ok=True)

    def doc():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) + "."

    for i in range(n_chunks):
        with open(source / f"text.chunk.{i}.jsonl", "w") as f:
            for _ in range(docs_per_chunk):
                f.write(json.dumps({"text": doc()}) + "\n")
    with open(source / "text.val.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": doc()}) + "\n")
    return root


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    from setup.make_tiny_teacher import make_tiny_teacher

    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", seed=0)


def read_metrics(dump_dir: Path) -> list[dict]:
    path = Path(dump_dir) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def train_rows(dump_dir: Path) -> dict[int, dict]:
    """step -> the training metrics row of that step (eval rows excluded)."""
    return {r["step"]: r for r in read_metrics(dump_dir) if "loss/ce" in r}


def base_overrides(corpus: Path, dump_dir: Path, steps: int = 10, **extra) -> list[str]:
    """A tiny CPU run on the test corpus with the byte tokenizer."""
    overrides = {
        "dump_dir": str(dump_dir), "steps": steps, "data.root_dir": str(corpus), "data.sources": "{text: 1.0}",
        "data.batch_size": 2, "data.seq_len": 32, "data.tokenizer.name": "bytes", "model.dim": 32,
        "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seqlen": 32,
        "distributed.model_dtype": "fp32", "distributed.init_timeout_s": 60, "distributed.train_timeout_s": 30,
        "logging.freq": 1, "checkpoint.dump.every": 1000, "optim.warmup": 2, "optim.lr": 3e-3,
        "data.load_async": "false", "eval.every": 0,
    }
    overrides.update(extra)
    return [f"{k}={v}" for k, v in overrides.items()]


def distill_overrides(corpus: Path, teacher: Path, dump_dir: Path, steps: int = 6, **extra) -> list[str]:
    """2 students + 1 tiny teacher, students on the teacher's tokenizer."""
    kd = {"enable_distillation": "true", "distillation.teacher_path": str(teacher), "distillation.k": 8,
          "distillation.teacher_dtype": "fp32", "data.tokenizer.name": "hf", "data.tokenizer.path": str(teacher)}
    kd.update(extra)
    return base_overrides(corpus, dump_dir, steps=steps, **kd)
