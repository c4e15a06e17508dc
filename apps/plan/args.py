"""The planner's inputs (`PlanArgs`: a training config plus the cluster) and the constants its models use."""

import math
from dataclasses import dataclass, field
from typing import Optional

from apps.main.train import TrainArgs
from lingua.args import fill_training_defaults, require

# The plan JSON's layout: 2 = cache.writer (was writer_overrides), the verdict's keys, the pilot's read command.
PLAN_VERSION = 2
MAX_WAIT_SHARE = 0.05  # of a student's step spent waiting on its teacher
AUTO_LOGITS_WORK_TENSORS, AUTO_LOGITS_FREE_SHARE = 4, 0.25  # lingua/distillation/teacher/model.py's auto logits chunk rule
USABLE_MEMORY = 0.9  # of a GPU's memory: the allocator's fragmentation and what the driver keeps
RUNTIME_RESERVE_GIB = 2.0  # per teacher rank: CUDA context, NCCL buffers, cuBLAS workspaces
# Per logit of a chunk at the peak of sparsify_teacher_logits: the fp32 logits, their tempered copy or an exp
# temporary, the log-probs; "sampled" also holds the probabilities.
LOGIT_BYTES = {"topk": 12, "full": 12, "sampled": 16}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GIB = 2**30
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass
class PlanArgs(TrainArgs):
    """The training config (`config=`, its keys as overrides) plus the cluster and what is known of its speed."""

    world_size: int = 0  # GPUs of the launch (whole nodes)
    gpus_per_node: int = 8  # GPUs of one node (a teacher replica stays inside a node)
    gpu_mem_gib: float = 80.0  # memory of one GPU in GiB (what the teacher's weights and requests must fit)
    # the teacher's config.json (its sizes); null = <distillation.teacher_path>/config.json
    teacher_config: Optional[str] = None
    teacher_tokens_per_s: float = 0.0  # measured, per teacher GPU (a replica's tokens/s / teacher_tp); 0 = cost model
    student_tokens_per_s: float = 0.0  # measured, per student GPU; 0 = cost model
    # distillation.cross_tokenizer: the teacher's tokens per student token on your data (its forward's work per
    # student token scales by it), as `python -m apps.bench.alignment_cost` prints it for the pair; 0 = measured by
    # the planner where both tokenizers are on this machine (else it asks for it); 1 without cross_tokenizer
    teacher_tokens_per_student_token: float = 0.0
    # several teachers (distillation.teachers, apps/plan/teachers.py): each one's config.json, in order;
    # [] = <teachers[i].path>/config.json
    teacher_configs: list[str] = field(default_factory=list)
    # each teacher's tokens per student token (as teacher_tokens_per_student_token), in order; [] = 1 each
    teachers_tokens_per_student_token: list[float] = field(default_factory=list)
    # each teacher's tokens/s per teacher GPU, measured, in order; [] = the cost model
    teachers_tokens_per_s: list[float] = field(default_factory=list)
    gpu_tflops: float = 989.0  # dense bf16 peak of one GPU (H100 SXM), for the cost model
    mfu: float = 0.4  # the share of that peak the teacher and the students reach, for the cost model
    planned_runs: int = 1  # training runs that could share one teacher cache
    tokens_per_run: int = 0  # student tokens of a run; 0 = steps x grad_acc_steps x batch_size x seq_len x students
    unique_tokens: float = 0.0  # unique training tokens there are (the data wall); 0 = every token fresh
    # a kd_study results.json (your pilot's); null = this repository's: docs/kd_study/results.json for fresh data,
    # docs/kd_study/wall/results.json with unique_tokens
    kd_measurement: Optional[str] = None
    repeat_decay: float = 15.4  # R_D* of the effective-data law for repeated tokens (Muennighoff et al. 2023's fit)
    show: str = "all"  # all: the plan and the verdict; verdict: whether to distill only
    out: Optional[str] = None  # where to write the plan as JSON (e.g. plan.json); null = print only

    def validate_plan(self) -> None:
        """The planner's keys and the training values it uses (not the data files: the cluster is elsewhere)."""
        require(self.world_size >= 2, "world_size", self.world_size,
                "pass the GPUs of the launch, at least 2 (one student and one teacher), e.g. world_size=64")
        require(self.gpus_per_node >= 1, "gpus_per_node", self.gpus_per_node, "use a positive number of GPUs")
        require(self.world_size % self.gpus_per_node == 0, "world_size", self.world_size,
                f"plan whole nodes: a multiple of gpus_per_node={self.gpus_per_node} (for part of a node, pass the "
                f"GPUs you use as gpus_per_node)")
        for key in ("gpu_mem_gib", "gpu_tflops"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, value, "use a positive number")
        require(math.isfinite(self.mfu) and 0 < self.mfu <= 1, "mfu", self.mfu, "use a share of the peak in (0, 1]")
        for key in ("teacher_tokens_per_s", "student_tokens_per_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, key, value,
                    "use measured tokens/s per GPU, or 0 for the cost model (gpu_tflops x mfu)")
        self.validate_teachers()
        ratio = self.teacher_tokens_per_student_token
        require(math.isfinite(ratio) and ratio >= 0, "teacher_tokens_per_student_token", ratio,
                "use the measured ratio (python -m apps.bench.alignment_cost prints it), e.g. 1.1, or 0 to let the "
                "planner measure it")
        require(ratio in (0, 1) or self.distillation.cross_tokenizer, "teacher_tokens_per_student_token", ratio,
                "a student on the teacher's tokenizer has one teacher token per student token; leave it at 1, or "
                "set distillation.cross_tokenizer=true")
        require(self.planned_runs >= 1, "planned_runs", self.planned_runs, "use 1 or more runs")
        require(self.tokens_per_run >= 0, "tokens_per_run", self.tokens_per_run,
                "use 0 (steps x grad_acc_steps x data.batch_size x data.seq_len x students) or a token count")
        require(math.isfinite(self.unique_tokens) and self.unique_tokens >= 0, "unique_tokens", self.unique_tokens,
                "use the unique training tokens there are (e.g. 2e9), or 0 for fresh data")
        require(math.isfinite(self.repeat_decay) and self.repeat_decay > 0, "repeat_decay", self.repeat_decay,
                "use a positive number of repetitions (15.4 is Muennighoff et al. 2023's fit)")
        require(self.show in ("all", "verdict"), "show", self.show, "use all or verdict")
        require(self.out is None or bool(self.out), "out", self.out, "name the JSON file, or null to print only")
        require(self.steps >= 1, "steps", self.steps, "train for at least one step")
        require(self.grad_acc_steps >= 1, "grad_acc_steps", self.grad_acc_steps, "use 1 (no accumulation) or more")
        for key in ("batch_size", "seq_len"):
            value = getattr(self.data, key)
            require(value >= 1, f"data.{key}", value, "use a positive number")
        fill_training_defaults(self)  # as the trainer reads the config: model.max_seqlen=-1 -> data.seq_len
        self.model.validate()
        require(self.model.max_seqlen >= self.data.seq_len, "model.max_seqlen", self.model.max_seqlen,
                f"the model must fit data.seq_len={self.data.seq_len}; set model.max_seqlen >= {self.data.seq_len}")
        self.distributed.validate()
        self.distillation.validate(enabled=False)  # its values; the planner picks the teacher ranks itself

    def validate_teachers(self) -> None:
        """The per-teacher lists: one value per element of distillation.teachers, and only with them."""
        teachers = self.distillation.teachers
        for key in ("teacher_configs", "teachers_tokens_per_student_token", "teachers_tokens_per_s"):
            values = getattr(self, key)
            require(not values or len(values) == len(teachers), key, values,
                    f"give one value per teacher of distillation.teachers ({len(teachers)})" if teachers else
                    "it is for several teachers (distillation.teachers); with one teacher use the key without the s")
        if not teachers:
            return
        for i, teacher in enumerate(teachers):
            require(not teacher.cache_dir, f"distillation.teachers[{i}].cache_dir", teacher.cache_dir,
                    "apps.plan plans teachers that run on their own ranks, and a teacher read from its cache has none; "
                    "plan with its path instead of its cache_dir")
            self.distillation.validate_teacher_ranks(i)  # validate(enabled=False) leaves the teachers' layout out
        for key, per_teacher in (("teacher_config", "teacher_configs"),
                                 ("teacher_tokens_per_s", "teachers_tokens_per_s")):
            require(not getattr(self, key), key, getattr(self, key),
                    f"with distillation.teachers give one value per teacher in {per_teacher}")
        require(self.teacher_tokens_per_student_token in (0, 1), "teacher_tokens_per_student_token",
                self.teacher_tokens_per_student_token,
                "with distillation.teachers give one ratio per teacher in teachers_tokens_per_student_token")
        for i, (ratio, teacher) in enumerate(zip(self.teachers_tokens_per_student_token, teachers)):
            require(math.isfinite(ratio) and ratio > 0 and (ratio == 1 or teacher.cross_tokenizer),
                    f"teachers_tokens_per_student_token[{i}]", ratio, "use the measured ratio of a cross-tokenizer "
                    "teacher (python -m apps.bench.alignment_cost prints it), or 1 for one on the students' tokenizer")
        for i, speed in enumerate(self.teachers_tokens_per_s):
            require(math.isfinite(speed) and speed >= 0, f"teachers_tokens_per_s[{i}]", speed,
                    "use measured tokens/s per teacher GPU, or 0 for the cost model")
