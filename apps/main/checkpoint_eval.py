"""Meta Lingua's `eval:` section: the evaluation run on each `checkpoint.eval` save, in-process or as a SLURM job.

    eval:
      harness: {tasks: [pydocs_cloze, hellaswag, {task: nq_open, num_fewshot: 5}]}   # lm-eval tasks
      validation: {max_steps: 100}                                                   # held-out loss
      generator: {temperature: 1.0, top_p: 0.95, max_tokens: 8192, dtype: bf16}     # generation tasks
    async_eval_gpus: null   # null: train rank 0 evaluates between steps; N: a job through stool

Both paths run `apps.main.eval.evaluate_checkpoint` on the saved step directory: its results go to
`<dump_dir>/evals/<step:010d>/eval.json`, and one line each is appended to `<dump_dir>/metrics.eval.jsonl` and
`<dump_dir>/metrics.validation.jsonl`, as Lingua writes them. A task that needs a dataset download and cannot get
it is a warning naming it; the run goes on. The in-loop held-out CE that used to sit under `eval:` is the
`heldout:` section now (`every`, `max_batches`, `uneven`); the old keys still work, with a warning.
"""

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from apps.main.eval import CheckpointEvalArgs, EvalArgs, evaluate_checkpoint, local_task_names, task_name
from lingua.args import dump_config, require
from lingua.errors import ConfigError, MissingPathError, PeerStopped, UserError, describe
from lingua.evaluation.heldout import eval_files
from lingua.logger import rank_log_file
from lingua.parallel.collectives import AgreedError, first_error
from lingua.parallel.timeouts import generous_timeout
from lingua.tokenizer import hf_form_problem

logger = logging.getLogger(__name__)

GENERATOR_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
DEPRECATED_KEYS = ("every", "max_batches", "uneven")  # the in-loop held-out CE's, before `heldout:`


@dataclass
class HarnessArgs:
    tasks: Optional[list[Any]] = None  # lm-eval task names, or task dicts ({task: nq_open, num_fewshot: 5})
    num_fewshot: Optional[int] = None  # None: each task's default
    limit: Optional[int] = None  # examples per task; None: all
    batch_size: int = 8  # lm-eval requests per forward of the evaluated model


@dataclass
class ValidationArgs:
    max_steps: Optional[int] = None  # held-out batches to score; None: all
    use_val_from_train_src: bool = True  # the training sources' *.val.jsonl
    root_dir: str = ""  # corpus root of `sources`; "": data.root_dir
    sources: list[str] = field(default_factory=list)  # more sources (folders under the root) to score


@dataclass
class GeneratorArgs:
    """Lingua's generator settings, as lm-eval's Hugging Face backend takes them (generation tasks only)."""
    temperature: float = 0.0  # sampling temperature of generation tasks; 0 = greedy
    top_p: Optional[float] = None  # nucleus sampling: the smallest set of tokens with this much probability; null = off
    top_k: Optional[int] = None  # sample among this many most likely tokens; null = off
    max_gen_len: int = 512  # new tokens per generation
    max_tokens: int = 1024  # tokens through the model per request (lm-eval's max_length)
    until: list[str] = field(default_factory=list)  # extra strings that stop a generation (besides each task's)
    dtype: str = "fp32"  # bf16 | fp32 | fp16
    device: Optional[str] = None  # None: cuda when there is one

    def gen_kwargs(self) -> str:
        """lm-eval's gen_kwargs string for these settings."""
        kwargs = {"do_sample": self.temperature > 0, "max_gen_toks": self.max_gen_len}
        if self.temperature > 0:
            kwargs["temperature"] = self.temperature
        for key in ("top_p", "top_k"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return ",".join(f"{key}={value}" for key, value in kwargs.items())


@dataclass
class EvalAtCheckpointArgs:
    harness: HarnessArgs = field(default_factory=HarnessArgs)
    validation: Optional[ValidationArgs] = None  # held-out loss at each eval checkpoint (its keys below); null = none
    generator: GeneratorArgs = field(default_factory=GeneratorArgs)
    dataset_dir: Optional[str] = None  # lm-eval's datasets cache (HF_DATASETS_CACHE) for the evaluation
    # Deprecated: the in-loop held-out CE, now `heldout.every` / `heldout.max_batches` / `heldout.uneven`.
    every: Optional[int] = None  # deprecated: heldout.every (steps between in-loop held-out evaluations)
    max_batches: Optional[int] = None  # deprecated: heldout.max_batches (held-out batches per rank)
    uneven: Optional[str] = None  # deprecated: heldout.uneven (ranks with unequal held-out batches: min or error)

    @property
    def enabled(self) -> bool:
        """Whether a checkpoint evaluation has anything to do (Lingua runs it when its config has `eval:`)."""
        return bool(self.harness.tasks) or self.validation is not None

    def validate(self) -> None:
        for i, task in enumerate(self.harness.tasks or []):
            require(isinstance(task, str) or (isinstance(task, dict) and isinstance(task.get("task"), str)),
                    f"eval.harness.tasks[{i}]", task, "use a task name or a mapping with its name under task:")
        require(self.harness.batch_size >= 1, "eval.harness.batch_size", self.harness.batch_size,
                "use a positive batch size")
        for key in ("num_fewshot", "limit"):
            value = getattr(self.harness, key)
            require(value is None or value >= (0 if key == "num_fewshot" else 1), f"eval.harness.{key}", value,
                    "use a positive number, or null")
        if self.validation is not None:
            require(self.validation.max_steps is None or self.validation.max_steps >= 1,
                    "eval.validation.max_steps", self.validation.max_steps, "use a positive number of batches, or null")
            require(self.validation.use_val_from_train_src or bool(self.validation.sources),
                    "eval.validation.use_val_from_train_src", False, "name eval.validation.sources to score, or set "
                    "it to true")
        gen = self.generator
        require(gen.dtype in GENERATOR_DTYPES, "eval.generator.dtype", gen.dtype,
                f"use one of {', '.join(GENERATOR_DTYPES)}")
        require(gen.temperature >= 0, "eval.generator.temperature", gen.temperature, "use 0 (greedy) or more")
        require(gen.top_p is None or 0 < gen.top_p <= 1, "eval.generator.top_p", gen.top_p, "use a number in (0, 1]")
        for key in ("max_gen_len", "max_tokens"):
            require(getattr(gen, key) >= 1, f"eval.generator.{key}", getattr(gen, key), "use a positive number")
        if self.dataset_dir is not None and not Path(self.dataset_dir).is_dir():
            raise MissingPathError(f"eval.dataset_dir={self.dataset_dir!r} is not a folder; point it at the "
                                   f"evaluation datasets cache or remove the key.")
        hub = [task_name(task) for task in self.harness.tasks or [] if task_name(task) not in local_task_names()]
        if hub:
            logger.warning(f"eval.harness.tasks {', '.join(hub)} are lm-eval tasks that read a Hugging Face dataset: "
                           f"without the hub (or a filled datasets cache) each is skipped with a warning at its "
                           f"checkpoint evaluation; shipped here and offline: {', '.join(local_task_names())}.")


def fold_deprecated_eval(eval_args: EvalAtCheckpointArgs, heldout: EvalArgs) -> None:
    """Move the old `eval.every / max_batches / uneven` (the in-loop held-out CE) into `heldout`, with a warning."""
    used = [key for key in DEPRECATED_KEYS if getattr(eval_args, key) is not None]
    if not used:
        return
    logger.warning(f"{', '.join('eval.' + key for key in used)}: the in-loop held-out CE is configured under "
                   f"heldout: now ({', '.join('heldout.' + key for key in used)}); eval: is Meta Lingua's "
                   f"checkpoint evaluation (harness, validation, generator).")
    for key in used:
        setattr(heldout, key, getattr(eval_args, key))
        setattr(eval_args, key, None)


def validate_eval_sections(args) -> None:
    """The `heldout:` and `eval:` sections and `async_eval_gpus` of a TrainArgs (after `data`'s own checks): tasks
    that cannot run with this tokenizer are refused here, not at the first checkpoint evaluation."""
    args.heldout.validate()
    args.eval.validate()
    problem = hf_form_problem(args.data.tokenizer) if args.eval.harness.tasks else None
    if problem:
        raise ConfigError(f"eval.harness.tasks are scored through the checkpoint's Hugging Face export, but {problem}; "
                          f"train with a tokenizer that converts (bytes, tiktoken, hf, a sentencepiece BPE model) "
                          f"or set eval.harness.tasks=[].")
    gpus = args.async_eval_gpus
    require(gpus is None or gpus >= 0, "async_eval_gpus", gpus, "use null (evaluate in-process), 0 (a CPU job) or "
            "the GPUs of the evaluation job")
    if gpus is not None and args.eval.enabled and args.checkpoint.eval.every and shutil.which("sbatch") is None:
        logger.warning(no_sbatch(gpus))
    if args.heldout.every:  # the held-out files exist (the data section's own checks passed)
        eval_files(args.data)


def no_sbatch(gpus: int) -> str:
    return (f"async_eval_gpus={gpus} submits each checkpoint evaluation as a SLURM job, but sbatch is not on PATH: "
            f"each is skipped with a warning; set async_eval_gpus=null to evaluate in-process.")


def eval_args_for(args, step: int, step_dir: Path) -> CheckpointEvalArgs:
    """The one evaluation (apps.main.eval) of checkpoint `step_dir`, from the training config."""
    section, validation, gen = args.eval, args.eval.validation, args.eval.generator
    sources = None
    if validation is not None and (validation.sources or not validation.use_val_from_train_src):
        train = [name for name, weight in args.data.sources.items() if weight > 0]
        sources = (train if validation.use_val_from_train_src else []) + list(validation.sources)
    return CheckpointEvalArgs(
        ckpt=str(step_dir), tasks=list(section.harness.tasks or []), dump_dir=str(Path(args.dump_dir) / "evals" /
                                                                                 f"{step:010d}"),
        metric_log_dir=str(args.dump_dir), global_step=step, limit=section.harness.limit,
        num_fewshot=section.harness.num_fewshot, batch_size=section.harness.batch_size, device=gen.device or "auto",
        dtype=GENERATOR_DTYPES[gen.dtype], max_length=gen.max_tokens, gen_kwargs=gen.gen_kwargs(),
        skip_unavailable_tasks=True, perplexity=validation is not None,
        perplexity_max_batches=validation.max_steps if validation is not None else None,
        data_dir=(validation.root_dir or None) if validation is not None else None, eval_sources=sources)


class CheckpointEvalFailed(AgreedError, RuntimeError):
    """A bug in the in-process checkpoint evaluation (lm-eval's, ours, out of memory), raised on the rank that ran it
    from the original error (its traceback kept), once every student agreed to stop."""


class CheckpointEvalStopped(AgreedError, PeerStopped):
    """The same failure on the students that only waited for it: the sentence names the rank and its log."""


class CheckpointEvaluation:
    """Runs Lingua's checkpoint evaluation after each save of kind "eval": on train rank 0 while the other students
    wait on the training group (async_eval_gpus=null), or as a job submitted through stool.

    In-process, the pause is long (a harness run takes minutes to hours) and known in advance (`announces_pause`, the
    checkpoint manager's eval cadence): every request a student posts during the step before it says so, and the
    teacher waits across it under `distributed.init_timeout_s`; the students wait under it too (every group of
    theirs, bridges included), then go back to the timeout in force. How it ends is agreed (`first_error` on the
    training group, also the barrier): a user's problem (a task that cannot run, a missing path) is a warning on
    every student and training goes on; anything else is a bug and ends the run on every student at once, the
    evaluating rank with its traceback, the others naming it (agreed errors also tell the teacher)."""

    def __init__(self, args, topo, checkpoint):
        self.args, self.topo, self.checkpoint = args, topo, checkpoint

    @property
    def in_process(self) -> bool:
        return self.args.eval.enabled and self.args.async_eval_gpus is None

    def pause_after(self, step: int) -> bool:
        """Whether an in-process checkpoint evaluation follows `step` (the same on every student)."""
        return self.in_process and self.checkpoint.eval_due(step)

    def announces_pause(self, step: int, feed) -> bool:
        """Whether the requests posted during `step` announce a pause to the teacher (the same on every student):
        an in-process evaluation follows `step`; or the look-ahead (`feed`) already sent the launch's last request
        (during `step` or before) and an evaluation follows `step` or a later one: the teacher then waits for STOP
        across it. That last case marks up to two steps early: the teacher's timeout there is only less tight."""
        if self.pause_after(step):
            return True
        last, sent_last = feed.last_step, feed.last_request_step()
        return last is not None and step >= sent_last and any(map(self.pause_after, range(step, last + 1)))

    def after_save(self, kinds: list[str], step: int, step_dir: Path, hang_watch=None,
                   timeout_in_force_s: Optional[float] = None) -> None:
        if "eval" not in kinds or not self.args.eval.enabled:
            return
        eval_args = eval_args_for(self.args, step, step_dir)
        if not self.in_process:
            if self.topo.is_train_master:
                try:
                    if shutil.which("sbatch") is None:
                        logger.warning(no_sbatch(self.args.async_eval_gpus))
                    else:
                        submit_eval_job(eval_args, self.args.async_eval_gpus, self.args.eval.dataset_dir,
                                        f"{self.args.name}_eval_{step}")
                except UserError as err:  # a user's eval problem must not end the training run
                    logger.warning(f"checkpoint evaluation of step {step} failed: {err}")
            return
        distributed = self.topo.distributed
        timeouts = self.args.distributed
        with (generous_timeout(self.topo, timeouts.init_timeout_s, timeout_in_force_s or timeouts.train_timeout_s,
                               hang_watch, step) if distributed else contextlib.nullcontext()):
            error, outcome = self._evaluate(eval_args, step) if self.topo.is_train_master else (None, None)
            agreed = (first_error(outcome, self.topo.train_group, "checkpoint evaluation") if distributed
                      else None if outcome is None else (0, outcome))
        if agreed is None:
            return
        rank, (bug, words) = agreed
        sentence = f"checkpoint evaluation of step {step} failed on train rank {rank}: {words}"
        if not bug:
            logger.warning(f"{sentence}; training goes on")
        elif error is not None:
            raise CheckpointEvalFailed(sentence) from error
        else:
            raise CheckpointEvalStopped(sentence)

    def _evaluate(self, eval_args: CheckpointEvalArgs, step: int) -> tuple[Optional[Exception], Optional[tuple]]:
        """This rank's in-process evaluation: (its error, (is a bug, its words)), both None when it succeeded."""
        logger.info(f"checkpoint evaluation of step {step} (in-process)")
        try:
            with dataset_cache(self.args.eval.dataset_dir):
                evaluate_checkpoint(eval_args)
            return None, None
        except UserError as err:  # a user's eval problem must not end the training run
            return err, (False, str(err))
        except Exception as err:
            log = rank_log_file()
            return err, (True, f"{describe(err)}" + (f"; its traceback is in {log}" if log else ""))


@contextlib.contextmanager
def dataset_cache(dataset_dir: Optional[str]):
    """HF_DATASETS_CACHE pointed at eval.dataset_dir during an in-process evaluation (unset: nothing changes)."""
    saved = os.environ.get("HF_DATASETS_CACHE")
    if dataset_dir:
        os.environ["HF_DATASETS_CACHE"] = str(Path(dataset_dir).resolve())
    try:
        yield
    finally:
        if dataset_dir and saved is None:
            os.environ.pop("HF_DATASETS_CACHE", None)
        elif dataset_dir:
            os.environ["HF_DATASETS_CACHE"] = saved


# sbatch hands the submitting process's environment to the job: the trainer's torchrun or srun variables would make
# the job's libraries (accelerate under lm-eval) wait for ranks that are not there.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_", "SLURM_", "SLURMD_", "SRUN_", "SBATCH_", "SUBMITIT_")


@contextlib.contextmanager
def launcher_env_removed():
    """The launcher's variables out of os.environ while a job is submitted, put back after."""
    saved = {key: value for key, value in os.environ.items()
             if key in LAUNCHER_ENV or key.startswith(LAUNCHER_ENV_PREFIXES)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def submit_eval_job(eval_args: CheckpointEvalArgs, gpus: int, dataset_dir: Optional[str], job_name: str) -> str:
    """Submit `python -m apps.main.eval` on this checkpoint through stool, into the evaluation's folder; the job
    goes where the training job went (partition, account, qos and environment from <dump_dir>/stool.yaml when
    stool launched the run). Our evaluation is one process: the job asks for one task, with a GPU when gpus >= 1."""
    from omegaconf import OmegaConf

    from lingua.args import dataclass_from_dict
    from lingua.stool import StoolArgs, launch

    eval_dir = Path(eval_args.dump_dir)
    eval_dir.mkdir(parents=True, exist_ok=True)
    config = eval_dir / "eval_args.yaml"
    dump_config(eval_args, config)
    run_stool = Path(eval_args.metric_log_dir) / "stool.yaml"
    inherited = {}
    if run_stool.is_file():
        run = dataclass_from_dict(StoolArgs, OmegaConf.load(run_stool))
        inherited = {key: getattr(run, key) for key in ("partition", "qos", "account", "constraint", "env_activate",
                                                        "python", "exports", "code_dirs")}
        inherited["env_activate"] = inherited["env_activate"] or "none"
    exports = dict(inherited.pop("exports", {}))
    if dataset_dir:
        exports["HF_DATASETS_CACHE"] = str(Path(dataset_dir).resolve())
    stool_args = StoolArgs(script="apps.main.eval", config=str(config), dump_dir=str(eval_dir), nodes=1,
                           ngpus=1 if gpus else 0, ntasks_per_node=1, ncpu=8 if gpus else 1, force=True,
                           job_name=job_name, exports=exports, **inherited)
    if gpus > 1:
        logger.info(f"async_eval_gpus={gpus}: the evaluation runs in one process, on one GPU")
    with launcher_env_removed():
        job_id = launch(stool_args, interactive=False)
    logger.info(f"checkpoint evaluation submitted as SLURM job {job_id}; results in {eval_dir}, metrics in "
                f"{eval_args.metric_log_dir}/metrics.eval.jsonl")
    return job_id
