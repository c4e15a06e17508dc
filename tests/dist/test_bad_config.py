"""Bad configs under torchrun, the real path. The rows of tests/bad_configs.py marked `launch`, one per way a
launch is refused (a value out of range, an unknown key, a world size the mesh cannot use, a teacher directory
that does not exist, a limit read from one that does), each run on the plain launch (2 ranks) or on the
distillation launch (2 students + 1 tiny teacher), the two in turn; two of them once more with the teacher rank starting its
config check only after torchrun has SIGTERMed it, as torchrun does to every rank still running once one
exits. Every rank exits 2 and prints no traceback; one rank prints the `error: ` sentence naming the key (the
others fail alike and stay quiet), torchrun's failure report shows it as the root cause (each rank's error file),
and no process group is ever created.

Every row's sentence is checked in-process, on both launches' configs, by tests/unit/lingua/parallel/test_launch_plan.py; what a
launch adds (torchrun, one process per rank, the SIGTERM) is the same for every row, so a few rows prove it.
The launches are cheap because validation runs before torch.distributed (and before the DTensor stack is
imported): about two CPU seconds per rank, plus torchrun's own start. They run two at a time; the module
prints their wall and CPU seconds (run pytest with -s to see them).
"""

import re
import resource
import time
from dataclasses import dataclass

import pytest

from tests.bad_configs import BAD_CONFIGS, BadConfig
from tests.runs import (LAUNCHES_AT_ONCE, at_once, base_overrides, distill_overrides, rank_exit_codes,
                        rank_outputs, torchrun)

pytestmark = pytest.mark.slow  # every test here launches processes

LAUNCHED = [bad for bad in BAD_CONFIGS if bad.launch]
WORLD_SIZES = {"plain": 2, "distill": 3, "sigterm": 3}
LATE_RANK = 2  # "sigterm": the distillation launch, its teacher rank checking its config last
SIGTERMED = ["negative_lr", "unknown_section_key"]  # a rule of validate() and one of the config parser
# Each row on one launch, the two kinds in turn (every row's sentence is checked on both configs in-process, and
# what a launch adds is the same for every row), plus the two SIGTERM launches: 8 launches, not 14 (CI's budget).
JOBS = [(bad, ("plain", "distill")[i % 2]) for i, bad in enumerate(LAUNCHED)] + \
       [(bad, "sigterm") for bad in LAUNCHED if bad.name in SIGTERMED]
# Per launch, start to exit. On a quiet 2-core machine a launch takes ~9 s (two at a time); the bound leaves
# room for a loaded CI machine while still failing any launch that waits on a collective (>= 60 s timeouts).
LAUNCH_LIMIT_S = 30.0


@dataclass
class Outcome:
    stdout: str  # torchrun's console: every rank's lines (prefixed [default<r>]:) and its summary
    ranks: dict  # rank -> {"stdout", "stderr"} as torchrun kept them
    exit_codes: dict  # rank -> exit code, from torchrun's summary
    seconds: float
    dump_dir: object


def launch(bad: BadConfig, kind: str, corpus, teacher, root) -> Outcome:
    dump, logs = root / f"{bad.name}-{kind}" / "dump", root / f"{bad.name}-{kind}" / "torchrun"
    base = base_overrides(corpus, dump, steps=3) if kind == "plain" else distill_overrides(corpus, teacher, dump, steps=3)
    args = base + bad.args(str(teacher))
    start = time.time()
    if kind == "sigterm":
        result = torchrun(WORLD_SIZES[kind], [str(LATE_RANK), *args], timeout=60, log_dir=logs,
                          module="tests.dist.workers.late_config_check")
    else:
        result = torchrun(WORLD_SIZES[kind], args, timeout=60, log_dir=logs)
    return Outcome(result.stdout, rank_outputs(logs), rank_exit_codes(result.stdout), time.time() - start, dump)


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped descendants: torchrun and the ranks it waited for
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def outcomes(corpus, tiny_teacher, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad_configs")
    start, cpu_start = time.time(), cpu_seconds_of_children()
    done = at_once(lambda job: launch(*job, corpus, tiny_teacher, root), JOBS)
    seconds = [o.seconds for o in done]
    # CPU seconds (torchrun and every rank) say what the launches cost a CI machine, whatever else runs beside it.
    print(f"\n{len(JOBS)} bad-config launches in {time.time() - start:.0f}s wall and "
          f"{cpu_seconds_of_children() - cpu_start:.0f}s CPU, {LAUNCHES_AT_ONCE} at a time "
          f"(each {min(seconds):.1f}-{max(seconds):.1f}s, median {sorted(seconds)[len(seconds) // 2]:.1f}s)")
    return {(bad.name, kind): outcome for (bad, kind), outcome in zip(JOBS, done)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("bad, kind", JOBS, ids=[f"{bad.name}-{kind}" for bad, kind in JOBS])
def test_bad_config_is_one_sentence_said_once_and_in_torchruns_report(outcomes, bad, kind):
    outcome = outcomes[(bad.name, kind)]
    tail = outcome.stdout[-4000:]
    world = WORLD_SIZES[kind]
    assert outcome.exit_codes == {rank: 2 for rank in range(world)}, tail
    assert sorted(outcome.ranks) == list(range(world)), tail
    errors = []
    for rank, output in outcome.ranks.items():
        lines = (output.get("stdout", "") + output.get("stderr", "")).splitlines()
        errors += [line for line in lines if line.startswith("error: ")]
        assert not any("Traceback" in line for line in lines), (rank, lines)
    assert len(errors) == 1, errors  # every rank fails alike; one of them says it
    assert bad.key in errors[0], errors[0]
    if bad.sentence is not None:
        assert errors[0] == f"error: {bad.sentence_of(kind)}"
    # torchrun's failure report carries it (each rank's error file), as its root cause; the others point to it.
    report = outcome.stdout[outcome.stdout.index("Root Cause (first observed failure):"):]
    assert re.search(r"^  traceback : (.*)$", report, flags=re.M).group(1) == errors[0][len("error: "):], tail
    others = re.findall(r"^  traceback : the same error as local rank \d+$", outcome.stdout, flags=re.M)
    assert len(others) == world - 1 and "<N/A>" not in outcome.stdout, tail
    # Refused before any process group: no rank got as far as torch.distributed or its log file.
    assert "process_group_init" not in outcome.stdout and not (outcome.dump_dir / "logs").exists()
    if kind == "sigterm":  # the late rank really was stopped by torchrun before it checked
        assert f"rank {LATE_RANK}: SIGTERM held before its config check" in outcome.ranks[LATE_RANK]["stdout"], tail
        assert re.search(r"Sending process \d+ closing signal SIGTERM", outcome.stdout), tail


@pytest.mark.timeout(400)
def test_every_launch_ends_within_seconds(outcomes):
    slow = {f"{name}-{kind}": round(o.seconds, 1) for (name, kind), o in outcomes.items() if o.seconds >= LAUNCH_LIMIT_S}
    assert not slow, f"launches over {LAUNCH_LIMIT_S}s: {slow}"
