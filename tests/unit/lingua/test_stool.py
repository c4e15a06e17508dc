"""lingua.stool without a cluster: argument handling, the generated script line by line, dry runs."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lingua import slurm, stool
from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout
from lingua.stool import StoolArgs

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(60)


def write_config(tmp_path: Path, n_teachers: int = 0, **extra) -> Path:
    cfg = {"name": "kd_run", "dump_dir": str(tmp_path / "dump"), "steps": 10,
           "enable_distillation": n_teachers > 0, "distillation": {"n_teacher_ranks": max(n_teachers, 1)}}
    cfg.update(extra)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def no_submit(*args, **kwargs):
    raise AssertionError("a dry run must not submit")


def dry_run(tmp_path, monkeypatch, n_teachers=0, config_extra=None, **options) -> tuple[Path, str]:
    """stool with dry_run=true; returns the dump dir and submit.slurm."""
    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    monkeypatch.setattr(stool, "submit_submitit", no_submit)
    config = write_config(tmp_path, n_teachers, **(config_extra or {}))
    options = {"time": 60, "env_activate": "none", "python": "/env/bin/python", **options}
    job_id = stool.launch(StoolArgs(config=str(config), dry_run=True, force=True, **options))
    assert job_id is None
    dump_dir = tmp_path / "dump"
    return dump_dir, (dump_dir / "submit.slurm").read_text()


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def srun_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return line


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "check.sh"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def expected_tail(dump: Path) -> list[str]:
    return [f"#SBATCH --output={dump}/logs/%j.stdout", f"#SBATCH --error={dump}/logs/%j.stderr",
            "#SBATCH --signal=USR2@120", "#SBATCH --open-mode=append", "#SBATCH --requeue"]


# ---------------------------------------------------------------- scripts, line by line

def test_one_node_gpus_one_teacher(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, n_teachers=1, ngpus=8, ncpu=12, partition="gpu", mem="400G")
    assert sbatch_lines(script) == [
        "#SBATCH --job-name=kd_run", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
        "#SBATCH --cpus-per-task=12", "#SBATCH --mem=400G", "#SBATCH --partition=gpu", "#SBATCH --time=60",
        *expected_tail(dump)]
    assert "#   teacher: global rank 7 (node 0, local rank 7)" in script
    assert "#   students: global ranks 0-6" in script
    assert srun_line(script) == (
        f"srun --kill-on-bad-exit=1 --distribution=block --open-mode=append --output={dump}/logs/%j/%j_%t.log "
        f"--ntasks=8 --ntasks-per-node=8 --cpus-per-task=12 /env/bin/python -u -m apps.main.train "
        f"config={dump}/config.yaml")
    config = yaml.safe_load((dump / "config.yaml").read_text())
    assert "teacher_placement" not in config.get("distributed", {})
    bash_syntax_ok(script, tmp_path)


def test_two_nodes_gpus_teacher_per_node(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, n_teachers=2, nodes=2, ngpus=8, qos="high", account="lab",
                           constraint="h100", exclude="node[3-4]", job_name="big")
    assert sbatch_lines(script) == [
        "#SBATCH --job-name=big", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
        "#SBATCH --cpus-per-task=8", "#SBATCH --qos=high", "#SBATCH --account=lab", "#SBATCH --constraint=h100",
        "#SBATCH --time=60", "#SBATCH --exclude=node[3-4]", *expected_tail(dump)]
    assert "# distillation: 2 teacher rank(s), placement per_node" in script
    assert "#   teacher: global rank 7 (node 0, local rank 7)" in script
    assert "#   teacher: global rank 15 (node 1, local rank 7)" in script
    assert "#   students: global ranks 0-6,8-14" in script
    assert "--ntasks=16 --ntasks-per-node=8" in srun_line(script)
    config = yaml.safe_load((dump / "config.yaml").read_text())
    assert config["distributed"]["teacher_placement"] == "per_node"
    bash_syntax_ok(script, tmp_path)


def test_two_nodes_explicit_last_placement_is_kept(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, n_teachers=2, nodes=2, ngpus=4,
                           overrides=["distributed.teacher_placement=last"])
    assert "#   teacher: global rank 6 (node 1, local rank 2)" in script
    assert "#   teacher: global rank 7 (node 1, local rank 3)" in script
    assert yaml.safe_load((dump / "config.yaml").read_text())["distributed"]["teacher_placement"] == "last"


def test_one_node_cpu_students_and_teacher(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, n_teachers=1, ngpus=0, ntasks_per_node=3, ncpu=1)
    lines = sbatch_lines(script)
    assert not any("gres" in line for line in lines)
    assert lines[:5] == ["#SBATCH --job-name=kd_run", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=3",
                         "#SBATCH --cpus-per-task=1", "#SBATCH --time=60"]
    assert not any(key in line for line in lines for key in ("--partition", "--qos", "--account", "--mem",
                                                             "--constraint", "--exclude"))
    assert "#   teacher: global rank 2 (node 0, local rank 2)" in script
    assert "export OMP_NUM_THREADS=1" in script.splitlines()
    bash_syntax_ok(script, tmp_path)


def test_two_nodes_cpu_no_distillation(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, nodes=2, ngpus=0, ntasks_per_node=2, ncpu=4)
    assert "#SBATCH --nodes=2" in sbatch_lines(script)
    assert not any("gres" in line for line in sbatch_lines(script))
    assert "# distillation off: every rank is a student" in script
    assert "--ntasks=4 --ntasks-per-node=2 --cpus-per-task=4" in srun_line(script)
    bash_syntax_ok(script, tmp_path)


def test_environment_lines(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, ngpus=2, env_activate="source /env/bin/activate",
                           exports={"NCCL_DEBUG": "INFO", "NOTE": "two words"},
                           sbatch_extra=["--mail-type=END", "#SBATCH --comment=kd"])
    lines = script.splitlines()
    start = lines.index("source /env/bin/activate")
    assert lines[start + 1] == 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    assert "export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))" in lines
    assert "export NCCL_DEBUG=INFO" in lines and "export NOTE='two words'" in lines
    assert lines.index("export NOTE='two words'") < lines.index(f"cd {dump}/code")
    assert sbatch_lines(script)[-2:] == ["#SBATCH --mail-type=END", "#SBATCH --comment=kd"]
    bash_syntax_ok(script, tmp_path)


@pytest.mark.slow
def test_environment_is_set_when_the_script_runs(tmp_path, monkeypatch):
    """Run the script's environment part with a fake scontrol: master host and port from the job."""
    dump, script = dry_run(tmp_path, monkeypatch, ngpus=2, exports={"NOTE": "two words"})
    env_part = script.split(f"cd {dump}/code")[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'node7\\nnode8\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    probe = tmp_path / "env.sh"
    probe.write_text(env_part + 'echo "$MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS $NOTE"\n')
    result = subprocess.run(["bash", str(probe)], capture_output=True, text=True,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123456",
                                 "SLURM_JOB_NODELIST": "node[7-8]"})
    assert result.stdout.split() == ["node7", str(10000 + 123456 % 20000), "8", "two", "words"], result.stderr


def run_env_part(tmp_path: Path, dump: Path, script: str, job_id: int) -> str:
    """The script's lines before `cd <code>`, run with a fake scontrol; returns "$MASTER_ADDR $MASTER_PORT"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'node7\\nnode8\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    probe = tmp_path / "env.sh"
    probe.write_text(script.split(f"cd {dump}/code")[0] + 'echo "$MASTER_ADDR $MASTER_PORT"\n')
    result = subprocess.run(["bash", str(probe)], capture_output=True, text=True,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": str(job_id),
                                 "SLURM_JOB_NODELIST": "node[7-8]"})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
def test_master_port_stays_below_the_ephemeral_range(tmp_path, monkeypatch):
    """Linux hands out outgoing ports from 32768 up by default: the rendezvous port never comes from there."""
    dump, script = dry_run(tmp_path, monkeypatch)
    ports = {job_id: int(run_env_part(tmp_path, dump, script, job_id).split()[1])
             for job_id in (1, 19999, 20000, 29999, 123456, 4294967294)}
    assert ports == {1: 10001, 19999: 29999, 20000: 10000, 29999: 19999, 123456: 13456, 4294967294: 17294}
    assert max(ports.values()) < 32768


@pytest.mark.slow
def test_exports_can_override_the_master_port(tmp_path, monkeypatch):
    """The escape hatch when the derived port is taken on the first node: user exports come after it."""
    dump, script = dry_run(tmp_path, monkeypatch, exports={"MASTER_PORT": 23456})
    assert run_env_part(tmp_path, dump, script, 123456) == "node7 23456"


def test_torchrun_per_node(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, nodes=2, ngpus=8, ncpu=4, torchrun_per_node=True)
    line = srun_line(script)
    assert line.startswith(f"srun --kill-on-bad-exit=1 --distribution=block --open-mode=append "
                           f"--output={dump}/logs/%j/%j_node%n.log --ntasks=2 --ntasks-per-node=1 "
                           f"--cpus-per-task=32 bash -c ")
    assert ("trap '\"'\"''\"'\"' USR2; exec /env/bin/python -u -m torch.distributed.run --nnodes=2 "
            "--nproc-per-node=8 --node-rank=$SLURM_NODEID --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT "
            f"--max-restarts=0 -m apps.main.train config={dump}/config.yaml") in line
    assert "#SBATCH --ntasks-per-node=8" in sbatch_lines(script)
    bash_syntax_ok(script, tmp_path)


# ---------------------------------------------------------------- dump dir

def test_dry_run_writes_the_dump_dir(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, ngpus=1, overrides=["steps=77", "optim.lr=0.01"])
    assert (dump / "logs").is_dir()
    assert (dump / "code" / "lingua" / "stool.py").read_text() == Path(stool.__file__).read_text()
    assert (dump / "code" / "apps" / "main" / "train.py").exists()
    assert not list((dump / "code").rglob("__pycache__"))
    config = yaml.safe_load((dump / "config.yaml").read_text())
    assert config["steps"] == 77 and config["optim"]["lr"] == 0.01 and config["dump_dir"] == str(dump)
    assert yaml.safe_load((dump / "stool.yaml").read_text())["overrides"] == ["steps=77", "optim.lr=0.01"]
    # The trainer learns the USR2 grace, to warn when a step plus a save would outlast it.
    assert config["preemption_grace_s"] == 120 and "--signal=USR2@120" in (dump / "submit.slurm").read_text()


def test_grace_goes_only_to_the_trainer(tmp_path, monkeypatch):
    dump, _ = dry_run(tmp_path, monkeypatch, ngpus=1, signal_grace_s=300)
    assert yaml.safe_load((dump / "config.yaml").read_text())["preemption_grace_s"] == 300
    dump, _ = dry_run(tmp_path, monkeypatch, ngpus=1, script="tests.slurm.fake_trainer")
    assert "preemption_grace_s" not in yaml.safe_load((dump / "config.yaml").read_text())


def test_submission_calls_sbatch_on_the_script(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "4242;cluster\n", "")

    config = write_config(tmp_path)
    real_run = subprocess.run
    monkeypatch.setattr(stool.subprocess, "run", lambda cmd, **kw: fake_run(cmd, **kw) if cmd[0] == "sbatch"
                        else real_run(cmd, **kw))
    job_id = stool.launch(StoolArgs(config=str(config), force=True, time=30, ngpus=1))
    assert job_id == "4242"
    assert calls == [["sbatch", "--parsable", str(tmp_path / "dump" / "submit.slurm")]]


def test_relative_paths_that_exist_become_absolute(tmp_path):
    (tmp_path / "data" / "corpus").mkdir(parents=True)
    config = write_config(tmp_path, dump_dir="dumps/run", data={"root_dir": "data/corpus", "missing": "data/nope"},
                          tokenizer={"name": "bytes"})
    cfg = stool.load_train_config(StoolArgs(config=str(config)), cwd=tmp_path)
    assert cfg.dump_dir == str(tmp_path / "dumps" / "run")
    assert cfg.data.root_dir == str(tmp_path / "data" / "corpus")
    assert cfg.data.missing == "data/nope" and cfg.tokenizer.name == "bytes"


@pytest.mark.parametrize("overrides, key", [
    (["data.root_dir=data/hf"], "data.root_dir='data/hf'"),
    (["data.tokenizer.path=tokenizers/cl_toplang_128k.tiktoken"],
     "data.tokenizer.path='tokenizers/cl_toplang_128k.tiktoken'"),
    (["distillation.teacher_path=models/llama/Llama-3.1-8B"], "distillation.teacher_path='models/llama/Llama-3.1-8B'"),
    (["distillation.teachers=[{path: ./teachers/a}]"], "distillation.teachers[0].path='./teachers/a'"),
])
def test_a_relative_path_the_job_cannot_reach_is_refused_at_submission(tmp_path, monkeypatch, overrides, key):
    """Issue 44: `data/hf` from a Lingua config, relative to nothing the job will have, fails before the queue."""
    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    with pytest.raises(FileNotFoundError) as refused:
        stool.launch(StoolArgs(config=str(config), dry_run=True, force=True, time=10, ngpus=1, overrides=overrides))
    assert str(refused.value).startswith(
        f"{key} is a relative path that exists neither from here ({tmp_path}) nor in the job's code snapshot "
        f"({tmp_path / 'dump' / 'code'}), which the job runs from; pass it as an absolute path"), str(refused.value)
    assert not (tmp_path / "dump").exists()  # nothing written


def test_what_the_job_can_reach_is_submitted(tmp_path, monkeypatch):
    """A hub id is no path, a path inside the code snapshot (configs/...) reaches the job, and one that exists from
    here becomes absolute."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "hf").mkdir(parents=True)
    config = write_config(tmp_path)
    cfg = stool.load_train_config(StoolArgs(config=str(config), overrides=[
        "distillation.teacher_path=HuggingFaceTB/SmolLM2-135M", "data.root_dir=data/hf",
        "checkpoint.init_ckpt_path=configs/teachers"]), cwd=tmp_path)
    assert cfg.distillation.teacher_path == "HuggingFaceTB/SmolLM2-135M"
    assert cfg.data.root_dir == str(tmp_path / "data" / "hf")
    assert cfg.checkpoint.init_ckpt_path == "configs/teachers"


def test_reusing_a_dump_dir_needs_confirmation(tmp_path, monkeypatch):
    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    config = write_config(tmp_path)
    dump = tmp_path / "dump"
    (dump / "checkpoints").mkdir(parents=True)
    args = StoolArgs(config=str(config), dry_run=True, time=10, ngpus=1)

    with pytest.raises(ValueError, match="force=true"):
        stool.launch(args, interactive=False)
    with pytest.raises(SystemExit, match="aborted"):
        stool.launch(args, input_fn=lambda prompt: "n", interactive=True)
    assert not (dump / "config.yaml").exists()

    prompts = []
    stool.launch(args, input_fn=lambda prompt: prompts.append(prompt) or "y", interactive=True)
    assert len(prompts) == 1 and str(dump) in prompts[0]
    assert (dump / "config.yaml").exists() and (dump / "checkpoints").is_dir()

    stool.launch(StoolArgs(config=str(config), dry_run=True, time=10, ngpus=1, force=True),
                 input_fn=no_submit, interactive=True)


# ---------------------------------------------------------------- arguments

def test_cli_options_then_training_overrides():
    args = stool.parse_stool_args(["config=c.yaml", "nodes=2", "overrides=[steps=5]", "exports.NCCL_DEBUG=INFO",
                                   "--", "optim.lr=1e-3", "data.sources={text: 1.0}"])
    assert args.nodes == 2 and args.exports == {"NCCL_DEBUG": "INFO"}
    assert args.overrides == ["steps=5", "optim.lr=1e-3", "data.sources={text: 1.0}"]
    with pytest.raises(ValueError, match="ngpu"):
        stool.parse_stool_args(["config=c.yaml", "ngpu=2"])


def test_argument_errors(tmp_path):
    config = str(write_config(tmp_path))
    with pytest.raises(ValueError, match="ntasks_per_node"):
        stool.resolve_args(StoolArgs(config=config, ngpus=0))
    assert stool.resolve_args(StoolArgs(config=config, ngpus=4)).ntasks_per_node == 4
    with pytest.raises(ValueError, match="launcher"):
        stool.resolve_args(StoolArgs(config=config, launcher="pbs"))
    with pytest.raises(ValueError, match="config="):
        stool.resolve_args(StoolArgs())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stool.launch(StoolArgs(config=str(tmp_path / "nope.yaml"), dry_run=True))
    bare = tmp_path / "bare.yaml"
    bare.write_text("steps: 3\n")
    with pytest.raises(ValueError, match="dump_dir"):
        stool.launch(StoolArgs(config=str(bare), dry_run=True, ngpus=1, time=5))


def test_teacher_layout_that_cannot_work_is_rejected_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    config = write_config(tmp_path, n_teachers=3)
    with pytest.raises(ValueError, match="student"):
        stool.launch(StoolArgs(config=str(config), dry_run=True, force=True, ngpus=0, ntasks_per_node=3, time=5))
    assert not (tmp_path / "dump").exists()


@pytest.mark.parametrize("text, minutes", [
    ("infinite", None), ("UNLIMITED", None), ("30", 30), ("30:00", 30), ("30:01", 31), ("2:00:00", 120),
    ("1-00:00:00", 1440), ("2-12", 3600), ("1-01:30", 1530)])
def test_parse_slurm_time(text, minutes):
    assert stool.parse_slurm_time(text) == minutes


def test_partition_time_limit_from_sinfo():
    def fake_sinfo(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 0, "debug* 2:00:00\nlong infinite\n", "")

    assert stool.partition_time_limit("", run=fake_sinfo) == 120
    assert stool.partition_time_limit("long", run=fake_sinfo) is None
    with pytest.raises(ValueError, match="debug\\*, long"):
        stool.partition_time_limit("gpu", run=fake_sinfo)


@pytest.mark.parametrize("limit, line", [(None, "#SBATCH --time=UNLIMITED"), (90, "#SBATCH --time=90")])
def test_default_time_is_the_partition_limit(tmp_path, monkeypatch, limit, line):
    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    config = write_config(tmp_path)
    stool.launch(StoolArgs(config=str(config), dry_run=True, force=True, ngpus=1), time_query=lambda p: limit)
    assert line in sbatch_lines((tmp_path / "dump" / "submit.slurm").read_text())


def test_no_time_line_when_sinfo_is_missing(tmp_path, monkeypatch):
    def no_sinfo(partition):
        raise FileNotFoundError("sinfo")

    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    stool.launch(StoolArgs(config=str(write_config(tmp_path)), dry_run=True, force=True, ngpus=1),
                 time_query=no_sinfo)
    assert not any("--time" in line for line in sbatch_lines((tmp_path / "dump" / "submit.slurm").read_text()))


def test_submitit_job_requeues_only_when_preempted_before_the_end(tmp_path):
    job = slurm.SubmititTrainJob("apps.main.train", "python", str(tmp_path), steps=10)
    assert not job.finished()
    (tmp_path / "checkpoints" / f"{4:010d}").mkdir(parents=True)
    assert not job.finished()
    (tmp_path / "checkpoints" / f"{10:010d}").mkdir()
    assert job.finished()
    assert job.command() == ["python", "-u", "-m", "apps.main.train", f"config={tmp_path}/config.yaml"]
    assert job.checkpoint().function is job


def test_submitit_dry_run_writes_the_same_dump_dir(tmp_path, monkeypatch):
    dump, script = dry_run(tmp_path, monkeypatch, launcher="submitit", ngpus=0, ntasks_per_node=3, ncpu=1)
    assert (dump / "config.yaml").exists() and (dump / "code" / "lingua" / "stool.py").exists()
    assert "--ntasks=3 --ntasks-per-node=3" in srun_line(script)  # the by-hand relaunch script
    with pytest.raises(ValueError, match="torchrun_per_node"):
        stool.resolve_args(StoolArgs(config="c.yaml", launcher="submitit", torchrun_per_node=True))


def test_submitit_executor_resources(tmp_path, monkeypatch):
    from submitit.slurm.slurm import SlurmExecutor

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # no srun needed to build it
    args = stool.resolve_args(StoolArgs(config="c.yaml", launcher="submitit", nodes=2, ngpus=4, ncpu=6, mem="100G",
                                        partition="gpu", qos="high", exports={"NOTE": "x y"}, env_activate="none",
                                        python="/env/bin/python", sbatch_extra=["--mail-type=END"]))
    layout = LaunchPlan(8, 4, (TeacherLayout(2),), teacher_placement="per_node")
    assert (layout.student_ranks, layout.teacher_ranks) == ([0, 1, 2, 4, 5, 6], [3, 7])
    executor = slurm.submitit_executor(args, tmp_path, layout, "90", "kd")
    text = executor._executor._make_submission_file_text("CMD", "uid")
    lines = text.splitlines()
    for expected in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gres=gpu:4",
                     "#SBATCH --cpus-per-task=6", "#SBATCH --mem=100G", "#SBATCH --partition=gpu",
                     "#SBATCH --qos=high", "#SBATCH --time=90", "#SBATCH --signal=USR2@120", "#SBATCH --requeue",
                     f"#SBATCH --chdir={tmp_path}/code", "#SBATCH --job-name=kd", "#SBATCH --mail-type=END",
                     "#SBATCH --open-mode=append", "export NOTE='x y'", "export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))",
                     "# distillation: 2 teacher rank(s), placement per_node"]:
        assert expected in lines, expected
    assert "--kill-on-bad-exit=1 --distribution=block CMD" in text
    assert executor._executor.max_num_timeout == 100  # not submitit's 3: a long run outlives many time limits
    bash_syntax_ok(text, tmp_path)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("ngpus", [0, 4])
@pytest.mark.parametrize("n_teachers", [0, 1])
def test_every_combination_of_nodes_gpus_and_teachers(tmp_path, monkeypatch, nodes, ngpus, n_teachers):
    """The full #SBATCH block, the srun line and the teacher layout for 1/2 nodes x CPU/GPU x KD on/off."""
    tasks = ngpus or 3
    options = dict(nodes=nodes, ngpus=ngpus, ncpu=2) if ngpus else dict(nodes=nodes, ngpus=0, ntasks_per_node=3, ncpu=2)
    dump, script = dry_run(tmp_path, monkeypatch, n_teachers=n_teachers, **options)
    gres = [f"#SBATCH --gres=gpu:{ngpus}"] if ngpus else []
    assert sbatch_lines(script) == [
        "#SBATCH --job-name=kd_run", f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={tasks}", *gres,
        "#SBATCH --cpus-per-task=2", "#SBATCH --time=60", *expected_tail(dump)]
    world = nodes * tasks
    assert srun_line(script) == (
        f"srun --kill-on-bad-exit=1 --distribution=block --open-mode=append --output={dump}/logs/%j/%j_%t.log "
        f"--ntasks={world} --ntasks-per-node={tasks} --cpus-per-task=2 /env/bin/python -u -m apps.main.train "
        f"config={dump}/config.yaml")
    if n_teachers:
        last = world - 1
        assert f"#   teacher: global rank {last} (node {last // tasks}, local rank {tasks - 1})" in script
        assert f"#   students: global ranks 0-{last - 1}" in script
    else:
        assert "# distillation off: every rank is a student" in script
    bash_syntax_ok(script, tmp_path)


# ---------------------------------------------------------------- tests/slurm never skips quietly in CI

def test_cannot_run_skips_or_fails_with_lingua_require_slurm(monkeypatch):
    from tests.slurm.conftest import cannot_run

    monkeypatch.delenv("LINGUA_REQUIRE_SLURM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no slurmctld here"):
        cannot_run("no slurmctld here")
    monkeypatch.setenv("LINGUA_REQUIRE_SLURM", "1")
    with pytest.raises(pytest.fail.Exception, match="LINGUA_REQUIRE_SLURM=1 but the SLURM tests cannot run: no slurmctld"):
        cannot_run("no slurmctld here")


def test_slurm_tests_skip_only_through_cannot_run():
    """A bare pytest.skip / skipif / importorskip / xfail in tests/slurm would pass CI without a cluster."""
    skips = {"skip", "skipif", "importorskip", "xfail"}
    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "slurm").glob("*.py")):
        tree = ast.parse(path.read_text())
        allowed = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "cannot_run"
                   for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in skips and id(node) not in allowed:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pytest"):
                found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if a.name in skips]
    assert not found, "use tests.slurm.conftest.cannot_run instead:\n" + "\n".join(found)


@pytest.mark.slow
def test_stool_and_the_launch_plan_import_without_torch():
    """stool prints and checks the trainer's own LaunchPlan on a login node that may have no torch."""
    code = "import sys, lingua.stool, lingua.parallel.launch_plan; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_mesh_that_does_not_fit_the_allocation_is_refused_at_submission(tmp_path, monkeypatch):
    monkeypatch.setattr(stool, "submit_sbatch", no_submit)
    config = write_config(tmp_path, n_teachers=1, distributed={"dp_shard": 4})
    with pytest.raises(ValueError, match=r"Mesh dp_replicate=1 x dp_shard=4 = 4 ranks, but there are 7 training ranks"):
        stool.launch(StoolArgs(config=str(config), dry_run=True, force=True, ngpus=8, time=5))
    assert not (tmp_path / "dump").exists()


def test_submitit_rank0_requeue_outlives_the_sigterm_the_requeue_sends(tmp_path, monkeypatch):
    """Rank 0 hands over to submitit's handler, whose `scontrol requeue` gets SLURM's SIGTERM for the requeued step
    before it exits: it still exits 0, so submitit logs the requeue instead of raising after it (CI run 3)."""
    import signal

    from tests.unit.lingua.parallel.test_preemption import fake_scontrol

    calls = fake_scontrol(tmp_path, monkeypatch)
    trainer = tmp_path / "bin" / "trainer"  # the trainer gets USR2 with its task process, saves and exits 0
    trainer.write_text("#!/bin/sh\nkill -USR2 $PPID\nexit 0\n")
    trainer.chmod(0o755)
    (tmp_path / "code").mkdir()
    monkeypatch.setattr(slurm.SubmititTrainJob, "command", lambda self: [str(trainer)])
    requeues = []

    def submitit_handler(signum, frame):  # submitit's checkpoint_and_try_requeue: its scontrol call, checked
        requeues.append(subprocess.run(["scontrol", "requeue", "7"]).returncode)

    previous = {sig: signal.signal(sig, handler) for sig, handler in
                ((signal.SIGUSR2, submitit_handler), (signal.SIGTERM, signal.getsignal(signal.SIGTERM)))}
    try:
        assert slurm.SubmititTrainJob("apps.main.train", "python", str(tmp_path), steps=10)() == 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert requeues == [0] and calls.read_text() == "requeue 7\n"
