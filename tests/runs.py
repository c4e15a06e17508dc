"""Launching runs for the tests and reading what they did: the one module the test files share.

torchrun (or a worker script) on CPU/gloo with a hard timeout, so a hang is a failure, not a stuck CI;
the overrides of the tiny standard runs (2 students, optionally + 1 tiny teacher); signals to ranks.
Reading a run's files goes through `lingua.run.dump_dir`, as the trainer and the benchmark do.
"""

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from lingua.run.dump_dir import RunDir, read_jsonl, read_metrics

ROOT = Path(__file__).resolve().parents[1]
FAULTY_TRAINER = "tests.fault_injection"  # apps.main.train with one injected failure (inject_failure=...)
LAUNCHES_AT_ONCE = 2  # on 2 cores: one launch's imports overlap the other's torchrun start-up and polling
Job = TypeVar("Job")

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


def base_overrides(corpus: Path, dump_dir: Path, steps: int = 10, **extra) -> list[str]:
    """A tiny CPU run on the test corpus with the byte tokenizer."""
    overrides = {
        "dump_dir": str(dump_dir), "steps": steps, "data.root_dir": str(corpus), "data.sources": "{text: 1.0}",
        "data.batch_size": 2, "data.seq_len": 32, "data.tokenizer.name": "bytes", "model.dim": 32,
        "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seqlen": 32,
        "distributed.model_dtype": "fp32", "distributed.init_timeout_s": 60, "distributed.train_timeout_s": 30,
        "logging.freq": 1, "checkpoint.dump.every": 1000, "optim.warmup": 2, "optim.lr": 3e-3,
        "data.load_async": "false", "heldout.every": 0, "logging.console": "all",  # tests read every rank's lines
    }
    overrides.update(extra)
    return [f"{k}={v}" for k, v in overrides.items()]


def distill_overrides(corpus: Path, teacher: Path, dump_dir: Path, steps: int = 6, **extra) -> list[str]:
    """2 students + 1 tiny teacher, students on the teacher's tokenizer, with a look-ahead request in flight
    (distillation.prefetch=auto would choose none where the 3 ranks share fewer cores)."""
    kd = {"enable_distillation": "true", "distillation.teacher_path": str(teacher), "distillation.k": 8,
          "distillation.teacher_dtype": "fp32", "distillation.prefetch": 1, "data.tokenizer.name": "hf",
          "data.tokenizer.path": str(teacher)}
    kd.update(extra)
    return base_overrides(corpus, dump_dir, steps=steps, **kd)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, module_args: list[str], timeout: float, env: dict | None = None,
             module: str = "apps.main.train", signal_plan=None, log_dir: Path | None = None,
             max_restarts: int = 0) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m module *module_args`; a run past `timeout` is a test failure.

    An `inject_failure=<kind>:<where>` among the trainer's args launches the trainer with that failure installed
    (tests/fault_injection.py) instead of `apps.main.train`.

    signal_plan: optional callable(popen) run while the job is alive (e.g. to deliver SIGUSR2).
    log_dir: torchrun also keeps each rank's stdout and stderr there (read them with `rank_outputs`).
    max_restarts: torchrun's in-job restarts (the README's single-node command: one agent, its shared store).
    """
    logs = ["--log-dir", str(log_dir), "--tee", "3"] if log_dir is not None else []
    if module == "apps.main.train" and any(arg.startswith("inject_failure=") for arg in module_args):
        module = FAULTY_TRAINER
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", str(max_restarts), *logs,
           "-m", module, *module_args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    # Drained from the start, also while signal_plan runs: a full pipe (64 KiB) would block the ranks' logging.
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(4096), "")), daemon=True)
    reader.start()
    try:
        if signal_plan is not None:
            signal_plan(proc)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(proc)
        proc.wait()
        reader.join(timeout=30)
        raise AssertionError(f"HANG: torchrun did not finish within {timeout}s\n{''.join(chunks)[-6000:]}")
    finally:
        if proc.poll() is None:  # the test was stopped from outside (pytest-timeout, a failed signal_plan)
            kill_launch(proc)
            proc.wait()
    reader.join(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(chunks), "")


def at_once(launch: Callable[[Job], object], jobs: Iterable[Job], n: int = LAUNCHES_AT_ONCE) -> list:
    """`launch(job)` for independent jobs, `n` at a time; the results in the jobs' order."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(launch, jobs))


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun launch: its ranks first (torchrun starts each in a session of its own, so they would
    outlive it and keep a core busy), then torchrun's process group."""
    for pid in worker_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def torchrun_nodes(nnodes: int, nproc_per_node: int, module_args: list[str], timeout: float,
                   module: str = "apps.main.train", max_restarts: int = 0,
                   signal_plan=None) -> list[subprocess.CompletedProcess]:
    """`nnodes` torchrun "nodes" of `nproc_per_node` ranks on this machine (--nnodes, --node-rank, one master
    address): a multi-node launch as the trainer sees it. A launch past `timeout` is a test failure.

    max_restarts > 0: the multi-node command of the README for in-job restarts instead (the c10d rendezvous, a fresh
    store per round: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). signal_plan: callable(popens) run while they live."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")

    def rendezvous(node: int) -> list[str]:
        if max_restarts == 0:
            return ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}"]

    if max_restarts:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                               "--nproc-per-node", str(nproc_per_node), *rendezvous(node), "--max-restarts",
                               str(max_restarts), "-m", module, *module_args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for node in range(nnodes)]
    # Drained from the start, also while signal_plan runs: a full pipe would block the ranks' logging.
    chunks: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, c=c: c.extend(iter(lambda: p.stdout.read(4096), "")), daemon=True)
               for p, c in zip(procs, chunks)]
    for reader in readers:
        reader.start()
    deadline = time.time() + timeout
    try:
        if signal_plan is not None:
            signal_plan(procs)
        for proc in procs:
            proc.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_launch(proc)
            proc.wait()
        for reader in readers:
            reader.join(timeout=30)
        raise AssertionError(f"HANG: {nnodes} torchrun nodes did not finish within {timeout}s\n"
                             + "\n".join("".join(c)[-3000:] for c in chunks))
    finally:
        for proc in procs:
            if proc.poll() is None:  # the test was stopped from outside (pytest-timeout, a failed signal_plan)
                kill_launch(proc)
                proc.wait()
    for reader in readers:
        reader.join(timeout=30)
    return [subprocess.CompletedProcess(proc.args, proc.returncode, "".join(c), "") for proc, c in zip(procs, chunks)]


def assert_ok(result) -> None:
    assert result.returncode == 0, result.stdout[-6000:]


def assert_stopped_to_resume(result, steps: int) -> int:
    """A launch preempted before its last step that nothing requeues: a non-zero exit, its sentence printed once
    (and in torchrun's failure report); returns the step it stopped at."""
    assert result.returncode != 0, result.stdout[-6000:]
    found = re.findall(rf"^error: stopped at step (\d+) of {steps} on ", result.stdout, flags=re.M)
    assert len(found) == 1, result.stdout[-6000:]
    assert re.search(rf"traceback : stopped at step {found[0]} of {steps} on ", result.stdout), result.stdout[-3000:]
    return int(found[0])


def rank_outputs(log_dir: Path) -> dict[int, dict[str, str]]:
    """Local rank -> {"stdout": ..., "stderr": ...} as torchrun's --log-dir kept them (one node)."""
    outputs: dict[int, dict[str, str]] = {}
    for path in Path(log_dir).glob("*/attempt_0/*/std*.log"):
        outputs.setdefault(int(path.parent.name), {})[path.stem] = path.read_text(errors="replace")
    return outputs


def rank_exit_codes(stdout: str) -> dict[int, int]:
    """Global rank -> exit code, for every rank torchrun's failure summary lists (ranks that exited 0 are not)."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stdout)}


def worker_pids(parent_pid: int) -> list[int]:
    """Child processes of torchrun (the ranks), in pid order."""
    children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children")
    if not children.exists():
        return []
    return sorted(int(p) for p in children.read_text().split())


def producer_pids(dump: Path, ranks: Iterable[int]) -> list[int]:
    """The data producer processes the ranks started (each logs its pid: lingua/loading/producer.py)."""
    pids = []
    for rank in ranks:
        log = RunDir(dump).rank_log(rank)
        text = log.read_text(errors="replace") if log.exists() else ""
        pids += [int(pid) for pid in re.findall(r"data-producer process started \(pid (\d+)\)", text)]
    return pids


def running(pid: int) -> bool:
    """The process exists and is not a zombie (dead, waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_no_orphan_producers(dump: Path, ranks: Iterable[int], within_s: float = 10.0) -> None:
    """Every data producer the ranks started is gone (they end with their rank, however it ends)."""
    pids = producer_pids(dump, ranks)
    assert pids, f"no rank of {list(ranks)} logged a data producer"
    deadline = time.time() + within_s
    while any(running(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if running(pid)], f"data producers outlived their ranks: {pids}"


def rank_pid(dump: Path, rank: int, timeout: float = 60) -> int:
    """The pid a rank wrote into its startup file."""
    path = RunDir(dump).startup(rank)
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = read_jsonl(path)
        if rows:
            return rows[0]["pid"]
        time.sleep(0.2)
    raise AssertionError(f"{path} never appeared")


def wait_for_step(dump: Path, step: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("step", 0) >= step for r in read_metrics(dump)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never logged")


def signal_ranks(dump: Path, ranks_and_delays: list[tuple[int, float]], after_step: int = 3,
                 delivered: list[int] | None = None, sig: signal.Signals = signal.SIGUSR2):
    """A signal_plan for torchrun(): `sig` (SLURM's SIGUSR2 unless told) to each rank, after `after_step` and a delay.

    The first signal must reach a live rank. A later one may find its rank already gone (the
    agreed stop, save and exit can all fit in the delay); it is then skipped. The ranks that got
    a signal are appended to `delivered`.
    """
    def plan(proc):
        wait_for_step(dump, after_step)
        for i, (rank, delay) in enumerate(ranks_and_delays):
            time.sleep(delay)
            try:
                os.kill(rank_pid(dump, rank), sig)
            except ProcessLookupError:
                if i == 0:
                    raise
                continue
            if delivered is not None:
                delivered.append(rank)
    return plan


def ranks_that_cleaned_up(stdout: str) -> set[int]:
    """Global ranks whose log says `clean_up` destroyed (normal exit) or aborted (exceptional exit) their process
    groups: the end of every exit path."""
    return {int(m.group(1)) for m in re.finditer(r"\[r(\d+) (?:student|teacher)\] INFO  lingua\.distributed: "
                                                   r"(?:process group destroyed|process groups aborted)$", stdout,
                                                   flags=re.M)}
