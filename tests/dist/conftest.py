"""Runs that several test files compare against, launched once per session."""

import pytest

from tests.runs import assert_ok, distill_overrides, torchrun

# 2 students + 1 tiny teacher, 6 steps of 2 micro-batches, in-loop eval (with the teacher's held-out CE) at 3 and 6.
ONLINE_KD = dict(steps=6, grad_acc_steps=2, **{"heldout.every": 3, "heldout.max_batches": 2})


@pytest.fixture(scope="session")
def online_kd_run(corpus, tiny_teacher, tmp_path_factory):
    """The dump dir of the plain online KD run (ONLINE_KD) that the teacher cache and the tensor-parallel teacher
    must reproduce step for step."""
    dump = tmp_path_factory.mktemp("online_kd") / "run"
    assert_ok(torchrun(3, distill_overrides(corpus, tiny_teacher, dump, **ONLINE_KD), timeout=150))
    return dump
