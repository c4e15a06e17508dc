"""Placement planner: how to split a cluster between a teacher and its students, before renting it.

    python -m apps.plan config=configs/llama_1B.yaml world_size=64 gpus_per_node=8 gpu_mem_gib=80 \\
        teacher_config=configs/teachers/llama3_8b.json [teacher_tokens_per_s=... student_tokens_per_s=...]

Prints a plan and writes it as JSON (`out=plan.json`; `out=null` prints only). Any training key overrides the
config as in training (`data.batch_size=8 distillation.k=32`). What it decides, in order:

1. Sizes. The teacher's from its config.json (`teacher_config=`, else `<distillation.teacher_path>/config.json`),
   counted as a Llama-family model (embeddings, q/k/v/o, gate/up/down, two norms a layer, a final norm, a head
   unless tied; biases where `attention_bias` / `mlp_bias` say so); the student's from the config's `model`
   section without building it (`num_parameters`), with the teacher's vocabulary when `model.vocab_size=-1`
   (a distilled student shares its teacher's tokenizer).
2. Speed. Tokens/s per GPU measured (`teacher_tokens_per_s`: one teacher GPU, i.e. a replica's rate / its
   teacher_tp; `student_tokens_per_s`: one student GPU), else the cost model: `gpu_tflops x mfu` over the
   FLOPs per token, the trainer's `get_num_flop_per_token` for a student (6 x matmul parameters + attention)
   and its forward third for the teacher (2 x matmul parameters + 4 x layers x width x seq_len). Their ratio is
   the teacher GPUs one student GPU keeps busy; a replica of t ranks is assumed t times as fast as one rank.
3. Memory per teacher rank at teacher_tp = t: the weights (vocabulary rows and projection rows or columns split
   t ways, norms replicated), one request's working memory (the replica's students' rows, the decoder and the head
   over `logits_chunk_rows` of them at a time: one layer's activations, the attention mask or scores and one logits
   chunk with its fp32 copies per chunk, every row's final hidden state, the outputs), a runtime reserve
   (`RUNTIME_RESERVE_GIB`), against `USABLE_MEMORY` of the GPU. t divides the attention and KV head counts and
   the GPUs of a node (a replica never leaves its node).
4. The layout. From the smallest t that fits, upward: the replica count whose students wait at most
   `MAX_WAIT_SHARE` of a step (with look-ahead a request costs a student max(0, L - C) per micro-batch, L the
   replica's time for it, C the student's compute) with the fewest teacher ranks; per_node before last at equal
   count (its bridges stay inside a node). Every layout printed is a `LaunchPlan` that constructed. When none
   keeps up: the layout with the most student throughput, and the largest smaller world size that would.
5. Online or the offline cache: GPU-hours per run of each road, the cache's size on disk, the number of runs
   from which the cache is the cheaper road, and the cache writer's overrides (`apps.main.teacher_cache` with
   replicas of the smallest teacher_tp that fits, one stream per student of a run from the cache).
"""

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from apps.main.teacher_cache import TeacherCacheArgs
from apps.main.train import TrainArgs
from apps.main.transformer import get_num_flop_per_token, num_parameters
from lingua.args import format_value, parse_args, require, to_dict
from lingua.cli import run_cli
from lingua.distillation.args import WIRE_DTYPES, check_seq_len_fits_teacher
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import ConfigError, DataError, MissingPathError
from lingua.parallel.launch_plan import LaunchPlan

PLAN_VERSION = 1
MAX_WAIT_SHARE = 0.05  # of a student's step spent waiting on its teacher
AUTO_LOGITS_WORK_TENSORS, AUTO_LOGITS_FREE_SHARE = 4, 0.25  # lingua/distillation/teacher.py's auto logits chunk rule
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
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    teacher_config: Optional[str] = None  # a config.json; default <distillation.teacher_path>/config.json
    teacher_tokens_per_s: float = 0.0  # measured, per teacher GPU (a replica's tokens/s / teacher_tp); 0 = cost model
    student_tokens_per_s: float = 0.0  # measured, per student GPU; 0 = cost model
    gpu_tflops: float = 989.0  # dense bf16 peak of one GPU (H100 SXM), for the cost model
    mfu: float = 0.4  # the share of that peak the teacher and the students reach, for the cost model
    planned_runs: int = 1  # training runs that could share one teacher cache
    tokens_per_run: int = 0  # student tokens of a run; 0 = steps x grad_acc_steps x batch_size x seq_len x students
    out: Optional[str] = "plan.json"  # the JSON plan; null = print only

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
        require(self.planned_runs >= 1, "planned_runs", self.planned_runs, "use 1 or more runs")
        require(self.tokens_per_run >= 0, "tokens_per_run", self.tokens_per_run,
                "use 0 (steps x grad_acc_steps x data.batch_size x data.seq_len x students) or a token count")
        require(self.out is None or bool(self.out), "out", self.out, "name the JSON file, or null to print only")
        require(self.steps >= 1, "steps", self.steps, "train for at least one step")
        require(self.grad_acc_steps >= 1, "grad_acc_steps", self.grad_acc_steps, "use 1 (no accumulation) or more")
        for key in ("batch_size", "seq_len"):
            value = getattr(self.data, key)
            require(value >= 1, f"data.{key}", value, "use a positive number")
        self.model.validate()
        self.distributed.validate()
        self.distillation.validate(enabled=False)  # its values; the planner picks the teacher ranks itself


# ---------------------------------------------------------------- sizes

@dataclass(frozen=True)
class TeacherShape:
    """What the planner needs of a teacher's config.json (its text config's for a multimodal one)."""

    path: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool
    mlp_bias: bool
    max_positions: Optional[int]

    def parameters(self, tp: int = 1) -> int:
        """Parameters on the first rank of a replica of `tp` ranks (the largest share; all of them with tp=1).
        Sharded as torch's plan shards them: vocabulary rows, q/k/v/gate/up output rows and o/down input
        columns split `tp` ways (torch.chunk sizes), norms and the biases of o/down replicated."""
        q, kv, ffn = ceil_div(self.heads * self.head_dim, tp), ceil_div(self.kv_heads * self.head_dim, tp), \
            ceil_div(self.intermediate, tp)
        layer = self.hidden * (2 * q + 2 * kv + 3 * ffn) + 2 * self.hidden  # q, o, k, v, gate/up/down; 2 norms
        layer += (q + 2 * kv + self.hidden) if self.attention_bias else 0
        layer += (2 * ffn + self.hidden) if self.mlp_bias else 0
        vocab_rows = ceil_div(self.vocab, tp) * self.hidden
        return vocab_rows * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def forward_flops_per_token(self, seq_len: int) -> int:
        """2 x the matmul parameters (the input embedding is a lookup; a tied head multiplies) plus attention's
        scores and values: a third of the trainer's training count for the same model."""
        matmul = self.parameters() - (0 if self.tied else self.vocab * self.hidden)
        return 2 * matmul + 4 * self.layers * self.heads * self.head_dim * seq_len


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def significant(value: float) -> float:
    """`value` to 4 significant digits, for the JSON (hours of a tiny run are not 0.0)."""
    return float(f"{value:.4g}")


def teacher_config_path(args: PlanArgs) -> Path:
    """teacher_config=, else the config.json in distillation.teacher_path; a sentence when there is neither."""
    if args.teacher_config:
        return Path(args.teacher_config).expanduser()
    require(bool(args.distillation.teacher_path), "teacher_config", args.teacher_config,
            "the config names no distillation.teacher_path: pass teacher_config=<the teacher's config.json> "
            "(configs/teachers/ holds Llama 3.1 8B and 70B and SmolLM2-135M)")
    return Path(args.distillation.teacher_path).expanduser() / "config.json"


def read_teacher_shape(path: Path) -> TeacherShape:
    """The teacher's sizes from its config.json; a missing file or key is one sentence naming the file."""
    if not path.is_file():
        raise MissingPathError(f"The teacher's config {path} does not exist; pass teacher_config=<its config.json> "
                                f"(configs/teachers/ holds Llama 3.1 8B and 70B and SmolLM2-135M), or point "
                                f"distillation.teacher_path at a local checkpoint directory.")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"The teacher's config {path} is not JSON ({err}); pass a transformers config.json.") from None
    if isinstance(config, dict) and "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal checkpoint: the language model's sizes
    if not isinstance(config, dict):
        raise DataError(f"The teacher's config {path} is not a JSON object; pass a transformers config.json.")
    for key in REQUIRED_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"The teacher's config {path} has {key}={format_value(value)}; the planner needs "
                             f"{', '.join(REQUIRED_KEYS)} as positive integers.")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or hidden // heads
    max_positions = config.get("max_position_embeddings")
    return TeacherShape(str(path), str(config.get("model_type", "unknown")), hidden, config["num_hidden_layers"],
                        heads, kv_heads, head_dim, config["intermediate_size"], config["vocab_size"],
                        bool(config.get("tie_word_embeddings", False)), bool(config.get("attention_bias", False)),
                        bool(config.get("mlp_bias", False)), max_positions if isinstance(max_positions, int) else None)


def student_flops_per_token(args: PlanArgs, n_params: int) -> int:
    """Training FLOPs per student token, as the trainer counts them for its MFU."""
    model = args.model
    matmul = n_params - (0 if model.tie_embeddings else model.vocab_size * model.dim)
    return get_num_flop_per_token(matmul, model.n_layers, model.dim, args.data.seq_len)


# ---------------------------------------------------------------- memory

@dataclass(frozen=True)
class TeacherMemory:
    """Bytes on one rank of a teacher replica while it serves one request."""

    weights: int
    activations: int  # one layer of one chunk of rows at a time, and the final hidden states of all rows
    attention: int  # a chunk's document mask (doc_causal, not flash or flex) or scores (eager attention)
    logits: int  # one chunk of distillation.logits_chunk_rows rows over this rank's vocabulary slice
    outputs: int  # the request, the sparse outputs' chunks and their concatenation
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.attention + self.logits + self.outputs + self.reserve

    def gib(self) -> dict:
        parts = {name: round(value / GIB, 2) for name, value in dataclasses.asdict(self).items()}
        return {**parts, "total": round(self.total / GIB, 2)}


def teacher_memory(shape: TeacherShape, tp: int, rows: int, args: PlanArgs, bytes_down: int,
                   bytes_up: int) -> TeacherMemory:
    """Memory of one teacher rank at teacher_tp=`tp` serving a request of `rows` sequences (students per bridge x
    data.batch_size) of data.seq_len tokens."""
    kd, seq = args.distillation, args.data.seq_len
    width = DTYPE_BYTES[teacher_dtype(args)]
    tokens = rows * seq
    widest = max(3 * ceil_div(shape.intermediate, tp),  # gate, up and their product
                 2 * ceil_div((shape.heads + 2 * shape.kv_heads) * shape.head_dim, tp)  # q, k, v and their rotations
                 + ceil_div(shape.heads * shape.head_dim, tp))  # the attention output
    row_bytes = seq * ceil_div(shape.vocab, tp) * LOGIT_BYTES[kd.output]
    weights, reserve = shape.parameters(tp) * width, int(RUNTIME_RESERVE_GIB * GIB)
    chunk_rows = kd.logits_chunk_rows
    if chunk_rows == 0:  # auto, as `TeacherModel.logits_chunk_rows` picks it on a GPU: the most rows, a power of
        # two, whose fp32 work fits a quarter of the memory free after loading
        free = max(USABLE_MEMORY * args.gpu_mem_gib * GIB - weights - reserve, 0)
        per_row = seq * ceil_div(shape.vocab, tp) * 4 * AUTO_LOGITS_WORK_TENSORS
        chunk_rows = 2 ** max(0, int(AUTO_LOGITS_FREE_SHARE * free // per_row).bit_length() - 1)
    chunk = min(chunk_rows, rows)  # the decoder, like the head, runs over this many rows at a time (no KV cache)
    # One layer of one chunk (+ the residual, its norm, the layer's output), and every row's final hidden state.
    activations = chunk * seq * width * (3 * shape.hidden + widest) + tokens * width * shape.hidden
    attention = 0
    implementation = str(kd.attn_implementation or "sdpa")
    if args.model.attn_mask == "doc_causal" and not implementation.startswith(("flash_attention", "flex_attention")):
        attention += chunk * seq * seq * (1 + width)  # a chunk's boolean document mask and its additive copy
    if implementation == "eager":
        attention += chunk * ceil_div(shape.heads, tp) * seq * seq * (2 * width + 4)  # scores, fp32 softmax, cast
    logits = chunk * row_bytes
    outputs = tokens * (bytes_up + 2 * bytes_down)
    return TeacherMemory(weights, activations, attention, logits, outputs, reserve)


def teacher_dtype(args: PlanArgs) -> str:
    """distillation.teacher_dtype on a GPU ("auto" loads bf16 there)."""
    return "bf16" if args.distillation.teacher_dtype == "auto" else args.distillation.teacher_dtype


# ---------------------------------------------------------------- time

@dataclass(frozen=True)
class Speeds:
    student: float  # tokens/s of one student GPU
    teacher: float  # tokens/s of one teacher GPU (a replica of t ranks: t times this)
    source: str

    @property
    def teacher_gpus_per_student_gpu(self) -> float:
        return self.student / self.teacher


@dataclass(frozen=True)
class Layout:
    """Replicas of `teacher_tp` ranks, each serving an equal block of the other ranks."""

    world_size: int
    teacher_tp: int
    replicas: int
    placement: str  # "last" | "per_node"

    @property
    def teacher_ranks(self) -> int:
        return self.replicas * self.teacher_tp

    @property
    def students(self) -> int:
        return self.world_size - self.teacher_ranks

    @property
    def students_per_bridge(self) -> int:
        return self.students // self.replicas

    def load(self, speeds: Speeds) -> float:
        """L / C: a replica's time for one request of all its students over one student's compute for it."""
        return self.students_per_bridge * speeds.teacher_gpus_per_student_gpu / self.teacher_tp


@dataclass(frozen=True)
class Timing:
    load: float  # L / C
    wait: float  # a student's wait per micro-batch over C
    wait_share: float  # of the student's step
    teacher_busy: float  # share of the replica's time spent computing

    @classmethod
    def of(cls, load: float, prefetch: int) -> "Timing":
        """With look-ahead the teacher's forward hides behind the student's whole step: wait = max(0, L - C); without
        it only behind the forward (a third of the training FLOPs): max(0, L - C/3)."""
        hidden = 1.0 if prefetch else 1 / 3
        wait = max(0.0, load - hidden)
        return cls(load, wait, wait / (1 + wait), load / (1 + wait))


def max_students_per_replica(tp: int, speeds: Speeds, prefetch: int) -> float:
    """Students one replica of `tp` ranks keeps under MAX_WAIT_SHARE (wait / (C + wait) <= share)."""
    hidden = 1.0 if prefetch else 1 / 3
    allowed_load = hidden + MAX_WAIT_SHARE / (1 - MAX_WAIT_SHARE)
    return allowed_load * tp / speeds.teacher_gpus_per_student_gpu


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending (O(sqrt n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidate_layouts(world_size: int, gpus_per_node: int, tp: int) -> list[Layout]:
    """Layouts of replicas of `tp` ranks that split `world_size` evenly: one per node (per_node, on more than one
    node: on one it is `last`), or any replica count dividing the world with a student left for each (last); a few
    dozen, never one per rank."""
    layouts = []
    if tp < gpus_per_node < world_size:
        layouts.append(Layout(world_size, tp, world_size // gpus_per_node, "per_node"))
    layouts += [Layout(world_size, tp, replicas, "last") for replicas in divisors(world_size)
                if world_size // replicas - tp >= 1]
    return layouts


def tensor_parallel_sizes(shape: TeacherShape, gpus_per_node: int) -> list[int]:
    """teacher_tp values that give each rank whole heads and stay inside a node."""
    return [t for t in divisors(gpus_per_node) if shape.heads % t == 0 and shape.kv_heads % t == 0]


# ---------------------------------------------------------------- the plan

class Planner:
    """Evaluates layouts of one config on one cluster; `plan()` returns the JSON-able plan. A student vocabulary
    of -1 in `args` becomes the teacher's, as the trainer makes it the tokenizer's."""

    def __init__(self, args: PlanArgs, config_path: Optional[str] = None):
        self.args, self.config_path = args, config_path
        self.shape = read_teacher_shape(teacher_config_path(args))
        check_seq_len_fits_teacher(args.data.seq_len, self.shape.max_positions or 0,
                                   f"max_position_embeddings in {self.shape.path}")
        if args.model.vocab_size == -1:  # the student speaks the teacher's tokenizer
            args.model = dataclasses.replace(args.model, vocab_size=self.shape.vocab)
        self.student_params = num_parameters(args.model)
        kd = args.distillation
        self.bytes_up = 4 + (4 if args.model.attn_mask == "doc_causal" else 0)  # int32 tokens (+ document ids)
        self.bytes_down = TeacherOutputs.bytes_per_token(kd.output, kd.k, args.model.vocab_size,
                                                         WIRE_DTYPES[kd.wire_dtype])
        self.speeds = self.measure_or_model()
        self.prefetch = kd.prefetch
        self.tp_sizes = tensor_parallel_sizes(self.shape, args.gpus_per_node)

    def measure_or_model(self) -> Speeds:
        args = self.args
        student_flops = student_flops_per_token(args, self.student_params)
        teacher_flops = self.shape.forward_flops_per_token(args.data.seq_len)
        peak = args.gpu_tflops * 1e12 * args.mfu
        student = args.student_tokens_per_s or peak / student_flops
        teacher = args.teacher_tokens_per_s or peak / teacher_flops
        measured = [name for name in ("student", "teacher") if getattr(args, f"{name}_tokens_per_s")]
        modelled = [name for name in ("student", "teacher") if name not in measured]
        words = [f"{' and '.join(measured)} measured"] if measured else []
        if modelled:
            words.append(f"{' and '.join(modelled)} from the cost model "
                         f"({args.gpu_tflops:g} TFLOP/s x MFU {args.mfu:g})")
        return Speeds(student, teacher, "; ".join(words))

    def memory(self, tp: int, students_per_bridge: int) -> TeacherMemory:
        """A teacher rank's memory at teacher_tp=`tp` while it serves `students_per_bridge` students' batches."""
        return self.memory_of_rows(tp, students_per_bridge * self.args.data.batch_size)

    def memory_of_rows(self, tp: int, rows: int) -> TeacherMemory:
        return teacher_memory(self.shape, tp, rows, self.args, self.bytes_down, self.bytes_up)

    def usable_bytes(self) -> float:
        return USABLE_MEMORY * self.args.gpu_mem_gib * GIB

    def fits(self, layout: Layout) -> bool:
        return self.memory(layout.teacher_tp, layout.students_per_bridge).total <= self.usable_bytes()

    def launch_plan(self, layout: Layout) -> LaunchPlan:
        """The trainer's own plan of `layout` with the config's mesh settings (ValueError: its sentence)."""
        distributed = dataclasses.replace(self.args.distributed, teacher_placement=layout.placement)
        return LaunchPlan.for_launch(distributed, layout.teacher_ranks, layout.world_size,
                                     min(self.args.gpus_per_node, layout.world_size), layout.teacher_tp)

    def timing(self, layout: Layout) -> Timing:
        return Timing.of(layout.load(self.speeds), self.prefetch)

    def useful_students(self, layout: Layout) -> float:
        """The launch's student throughput in student GPUs that never wait."""
        return layout.students / (1 + self.timing(layout).wait)

    def first_valid(self, layouts: list[Layout]) -> tuple[Optional[tuple[Layout, LaunchPlan]], Optional[str]]:
        """(the first of `layouts` the trainer's LaunchPlan accepts, with its plan; the sentence it refused the first
        refused one with), None where there is none."""
        refusal = None
        for layout in layouts:
            try:
                return (layout, self.launch_plan(layout)), refusal
            except ValueError as err:
                refusal = refusal or str(err)
        return None, refusal

    def smallest_fitting_tp(self, rows: Optional[int] = None) -> Optional[int]:
        """The smallest teacher_tp whose weights and a forward of `rows` sequences (one student's batch by default)
        fit a GPU."""
        rows = rows or self.args.data.batch_size
        return next((t for t in self.tp_sizes if self.memory_of_rows(t, rows).total <= self.usable_bytes()), None)

    def keeping_up(self, min_tp: int) -> tuple[Optional[tuple[Layout, LaunchPlan]], Optional[str]]:
        """From the smallest fitting teacher_tp up: the layout under MAX_WAIT_SHARE with the fewest teacher ranks
        (per_node first at equal count); else None and why the launch plan refused the first that kept up."""
        first_refusal = None
        for tp in (t for t in self.tp_sizes if t >= min_tp):
            good = [layout for layout in candidate_layouts(self.args.world_size, self.args.gpus_per_node, tp)
                    if self.timing(layout).wait_share <= MAX_WAIT_SHARE and self.fits(layout)]
            found, refusal = self.first_valid(sorted(good, key=lambda l: (l.teacher_ranks, l.placement != "per_node")))
            if found is not None:
                return found, None
            first_refusal = first_refusal or refusal
        return None, first_refusal

    def best_effort(self, min_tp: int) -> tuple[Optional[tuple[Layout, LaunchPlan]], Optional[str]]:
        """The layout with the most student throughput when none keeps up (fewer teacher ranks, smaller teacher_tp,
        per_node first at a tie)."""
        layouts = [layout for tp in self.tp_sizes if tp >= min_tp
                   for layout in candidate_layouts(self.args.world_size, self.args.gpus_per_node, tp)
                   if self.fits(layout)]
        ranked = sorted(layouts, key=lambda l: (-round(self.useful_students(l), 9), l.teacher_ranks, l.teacher_tp,
                                                l.placement != "per_node"))
        return self.first_valid(ranked)

    def smaller_world_that_keeps_up(self, min_tp: int) -> Optional[tuple[Layout, LaunchPlan]]:
        """The largest world size below the given one (whole nodes) with a layout under MAX_WAIT_SHARE."""
        options = []
        for tp in (t for t in self.tp_sizes if t >= min_tp):
            for per_bridge in range(1, math.floor(max_students_per_replica(tp, self.speeds, self.prefetch)) + 1):
                unit = math.lcm(tp + per_bridge, self.args.gpus_per_node)
                world = self.args.world_size // unit * unit
                if world:
                    options.append(Layout(world, tp, world // (tp + per_bridge), "last"))
        options = [layout for layout in options if self.fits(layout)]
        return self.first_valid(sorted(options, key=lambda l: (-l.world_size, l.teacher_ranks, l.teacher_tp)))[0]

    def why_none_keeps_up(self, min_tp: int) -> str:
        args, speeds = self.args, self.speeds
        largest = max(t for t in self.tp_sizes if t >= min_tp)
        most = max_students_per_replica(largest, speeds, self.prefetch)
        if most < 1:
            alone = Timing.of(speeds.teacher_gpus_per_student_gpu / largest, self.prefetch)
            return (f"even one student per replica of teacher_tp={largest} (the most a node of {args.gpus_per_node} "
                    f"and the teacher's heads allow) waits {alone.wait_share:.0%} of its step: the teacher needs "
                    f"{speeds.teacher_gpus_per_student_gpu:.2f} GPUs per student GPU")
        keeps = ", ".join(f"teacher_tp={t}: {math.floor(max_students_per_replica(t, speeds, self.prefetch))}"
                          for t in self.tp_sizes if t >= min_tp)
        return (f"{args.world_size} ranks do not split into equal blocks of one replica and the students it keeps up "
                f"with (at most, by teacher_tp: {keeps}; the teacher needs {speeds.teacher_gpus_per_student_gpu:.2f} "
                f"GPUs per student GPU)")

    def describe_layout(self, layout: Layout, plan: LaunchPlan) -> dict:
        args, timing = self.args, self.timing(layout)
        per_student_s = self.speeds.student / (1 + timing.wait)
        inside = all(len({rank // plan.local_world_size for rank in ranks + students}) == 1
                     for ranks, students in plan.replicas())
        overrides = (f"enable_distillation=true distillation.teacher_tp={layout.teacher_tp} "
                     f"distillation.n_teacher_ranks={layout.teacher_ranks} "
                     f"distributed.teacher_placement={layout.placement}")
        lines = plan.describe()
        return {
            "world_size": layout.world_size, "teacher_tp": layout.teacher_tp, "replicas": layout.replicas,
            "n_teacher_ranks": layout.teacher_ranks, "teacher_placement": layout.placement,
            "students": layout.students, "students_per_bridge": layout.students_per_bridge,
            "teacher_load": round(timing.load, 4), "wait_share": round(timing.wait_share, 4),
            "teacher_busy": round(timing.teacher_busy, 4),
            "student_tokens_per_s": round(layout.students * per_student_s),
            "bridges_inside_nodes": inside,
            "memory_gib": self.memory(layout.teacher_tp, layout.students_per_bridge).gib(),
            "bridge": {"bytes_up_per_token": self.bytes_up, "bytes_down_per_token": self.bytes_down,
                       "bytes_per_s": round(layout.students_per_bridge * per_student_s
                                            * (self.bytes_up + self.bytes_down))},
            "overrides": overrides,
            "launch_plan": lines[:6] + ([f"... {len(lines) - 6} more line(s)"] if len(lines) > 6 else []),
        }

    def cache_road(self, online: dict, tokens: int) -> dict:
        """GPU-hours of the online road and of the cache road for `tokens` student tokens per run."""
        args, speeds, seq = self.args, self.speeds, self.args.data.seq_len
        kd = args.distillation
        id_bytes = 2 if args.model.vocab_size <= 2**16 else 4
        outputs = (args.model.vocab_size * DTYPE_BYTES[kd.wire_dtype] if kd.output == "full"
                   else kd.k * (DTYPE_BYTES[kd.wire_dtype] + id_bytes) + 4)
        per_token = 4 * (seq + 1) / seq + (2 if seq + 1 <= 2**15 else 4) + outputs  # tokens, document ids, outputs
        teacher_pass = tokens / speeds.teacher / 3600
        students_only = tokens / speeds.student / 3600
        online_run = args.world_size * tokens / online["student_tokens_per_s"] / 3600
        runs = args.planned_runs
        cache_total, online_total = teacher_pass + runs * students_only, runs * online_run
        cheaper = "cache" if cache_total < online_total * (1 - MAX_WAIT_SHARE) else "online"
        road = {
            "tokens_per_run": tokens, "bytes_per_token": round(per_token, 3), "size_bytes": round(tokens * per_token),
            "read_bytes_per_s": round(args.world_size * speeds.student * per_token),
            "teacher_pass_gpu_hours": significant(teacher_pass),
            "teacher_pass_hours": significant(teacher_pass / args.world_size),
            "cache_run_gpu_hours": significant(students_only),
            "cache_run_hours": significant(students_only / args.world_size),
            "online_run_gpu_hours": significant(online_run),
            "online_run_hours": significant(online_run / args.world_size),
            "planned_runs": runs, "cache_gpu_hours": significant(cache_total),
            "online_gpu_hours": significant(online_total),
            "break_even_runs": significant(teacher_pass / (online_run - students_only)),
            "cheaper": cheaper,
        }
        # The writer's replicas: the smallest teacher_tp its forwards fit; every rank a teacher, a stream per student.
        writer_tp = self.smallest_fitting_tp(TeacherCacheArgs.forward_rows)
        road["writer_overrides"] = (f"distillation.teacher_tp={writer_tp} streams={args.world_size}" if writer_tp
                                    else None)
        return road

    def facts(self) -> dict:
        """What the plan rests on: the inputs, both models' sizes, the speeds and the memory at each teacher_tp."""
        args, shape, speeds = self.args, self.shape, self.speeds
        distillation = to_dict(args.distillation)
        return {
            "version": PLAN_VERSION,
            "inputs": {"config": self.config_path, "world_size": args.world_size, "gpus_per_node": args.gpus_per_node,
                       "gpu_mem_gib": args.gpu_mem_gib, "teacher_config": shape.path,
                       "teacher_tokens_per_s": args.teacher_tokens_per_s,
                       "student_tokens_per_s": args.student_tokens_per_s, "gpu_tflops": args.gpu_tflops,
                       "mfu": args.mfu, "planned_runs": args.planned_runs, "teacher_dtype": teacher_dtype(args),
                       "batch_size": args.data.batch_size, "seq_len": args.data.seq_len, "steps": args.steps,
                       "grad_acc_steps": args.grad_acc_steps, "prefetch": self.prefetch,
                       "distillation": {key: distillation[key] for key in
                                        ("output", "k", "wire_dtype", "logits_chunk_rows", "attn_implementation")}},
            "teacher": {"parameters": shape.parameters(), "model_type": shape.model_type, "layers": shape.layers,
                        "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.kv_heads,
                        "intermediate": shape.intermediate, "vocab": shape.vocab, "tied": shape.tied,
                        "forward_flops_per_token": shape.forward_flops_per_token(args.data.seq_len),
                        "teacher_tp_sizes": self.tp_sizes},
            "student": {"parameters": self.student_params, "vocab": args.model.vocab_size,
                        "train_flops_per_token": student_flops_per_token(args, self.student_params)},
            "speed": {"student_tokens_per_s_per_gpu": round(speeds.student, 1),
                      "teacher_tokens_per_s_per_gpu": round(speeds.teacher, 1), "source": speeds.source,
                      "teacher_gpus_per_student_gpu": round(speeds.teacher_gpus_per_student_gpu, 4)},
            "memory": {"usable_gib": round(self.usable_bytes() / GIB, 2), "min_teacher_tp": self.smallest_fitting_tp(),
                       "one_student_request": {t: self.memory(t, 1).gib() for t in self.tp_sizes}},
        }

    def no_layout(self, min_tp: Optional[int], refusal: Optional[str]) -> str:
        """Why no layout can be printed at all: the teacher does not fit, no split fits the memory, or the launch plan
        refuses every split (`refusal`: its sentence for the first)."""
        args = self.args
        if min_tp is None:
            largest = self.tp_sizes[-1]
            return (f"the teacher does not fit: at teacher_tp={largest} (the most a node of {args.gpus_per_node} "
                    f"and its heads allow) one rank needs {self.memory(largest, 1).total / GIB:.1f} GiB of the "
                    f"{self.usable_bytes() / GIB:.1f} usable; use larger GPUs, or lower data.batch_size or "
                    f"distillation.logits_chunk_rows")
        layouts = [layout for t in self.tp_sizes if t >= min_tp
                   for layout in candidate_layouts(args.world_size, args.gpus_per_node, t)]
        if not any(self.fits(layout) for layout in layouts):
            return (f"every split of {args.world_size} ranks gives a replica more students' rows than its memory "
                    f"holds; lower data.batch_size or distillation.logits_chunk_rows, or use larger GPUs")
        return f"the launch plan refuses every split of {args.world_size} ranks, the first with: {refusal}"

    def plan(self) -> dict:
        """The plan: the facts, the online layout (or why there is none), a smaller world size that keeps up when
        this one does not, the cache road, and the recommendation."""
        args, result = self.args, self.facts()
        min_tp = result["memory"]["min_teacher_tp"]
        found, reason, refusal = None, None, None
        if min_tp:
            found, refusal = self.keeping_up(min_tp)
        if min_tp and found is None:
            reason = (f"the launch plan refuses the layouts that would: {refusal}" if refusal
                      else self.why_none_keeps_up(min_tp))
            found, refusal = self.best_effort(min_tp)
        if found is None:
            result["online"] = {"keeps_up": False, "reason": self.no_layout(min_tp, refusal)}
            result["recommendation"] = "neither road: " + result["online"]["reason"]
            return result
        online = {"keeps_up": reason is None, "reason": reason, **self.describe_layout(*found)}
        result["online"] = online
        if reason is not None:
            smaller = self.smaller_world_that_keeps_up(min_tp)
            result["smaller_world_that_keeps_up"] = self.describe_layout(*smaller) if smaller else None
        tokens = args.tokens_per_run or (args.steps * args.grad_acc_steps * args.data.batch_size * args.data.seq_len
                                         * online["students"])
        cache = result["cache"] = self.cache_road(online, tokens)
        waiting = "" if reason is None else f"students would wait {online['wait_share']:.0%} of each step"
        if cache["cheaper"] == "cache":
            result["recommendation"] = (f"the offline cache: {cache['cache_gpu_hours']:,.0f} GPU-hours for "
                                        f"{args.planned_runs} run(s) against {cache['online_gpu_hours']:,.0f} online"
                                        + (f", where {waiting}" if waiting else ""))
        else:
            close = cache["cache_gpu_hours"] < cache["online_gpu_hours"]
            result["recommendation"] = (f"online: {online['overrides']}" + (f" ({waiting})" if waiting else "")
                                        + (f"; the cache would cost within {MAX_WAIT_SHARE:.0%} of its GPU-hours"
                                           if close else ""))
        return result


# ---------------------------------------------------------------- printing

def count(value: float) -> str:
    """8030261248 -> "8.03B"."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def size(n_bytes: float) -> str:
    """Bytes in decimal units: 12.4 TB."""
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {suffix}"
    return f"{n_bytes:.0f} B"


def hours(value: float) -> str:
    """Whole hours from 100 up, three digits below (a debug run's hours are not 0)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def summary_line(layout: dict) -> str:
    """One layout in a line: replicas, students, the wait and the teachers' busy share."""
    return (f"  teacher_tp={layout['teacher_tp']}, {layout['replicas']} replica(s), {layout['students_per_bridge']} "
            f"student(s) each ({layout['students']} students, {layout['n_teacher_ranks']} teacher ranks, placement "
            f"{layout['teacher_placement']}): students wait {layout['wait_share']:.0%} of a step, teachers busy "
            f"{layout['teacher_busy']:.0%}")


def layout_lines(online: dict) -> list[str]:
    """The online layout: its summary, memory, bridges, the overrides that launch it and its launch plan."""
    memory = online["memory_gib"]
    bridge = online["bridge"]
    return [
        summary_line(online),
        f"  memory per teacher rank: {memory['total']:.1f} GiB (weights {memory['weights']:.1f}, activations "
        f"{memory['activations']:.1f}, attention {memory['attention']:.1f}, logits {memory['logits']:.1f}, outputs "
        f"{memory['outputs']:.1f}, reserve {memory['reserve']:.1f})",
        f"  bridge: {bridge['bytes_up_per_token']} B/token up, {bridge['bytes_down_per_token']} down, "
        f"{size(bridge['bytes_per_s'])}/s per bridge; bridges inside nodes: "
        f"{'yes' if online['bridges_inside_nodes'] else 'no'}",
        f"  overrides: {online['overrides']}",
        *(f"  | {line}" for line in online["launch_plan"]),
    ]


def format_plan(plan: dict) -> list[str]:
    """The plan as the lines the planner prints."""
    inputs, teacher, student, speed = plan["inputs"], plan["teacher"], plan["student"], plan["speed"]
    memory = plan["memory"]
    lines = [
        f"plan: {inputs['config'] or 'the config'} on {inputs['world_size']} GPUs "
        f"({inputs['world_size'] // inputs['gpus_per_node']} node(s) x {inputs['gpus_per_node']}, "
        f"{inputs['gpu_mem_gib']:g} GiB each)",
        f"teacher: {inputs['teacher_config']}: {count(teacher['parameters'])} parameters ({teacher['model_type']}, "
        f"counted as a Llama-family model), {teacher['layers']} layers, hidden {teacher['hidden']}, heads "
        f"{teacher['heads']}/{teacher['kv_heads']} KV, vocab {teacher['vocab']:,}; "
        f"{teacher['forward_flops_per_token'] / 1e9:.3g} GFLOP/token forward",
        f"student: {count(student['parameters'])} parameters, vocab {student['vocab']:,}; "
        f"{student['train_flops_per_token'] / 1e9:.3g} GFLOP/token training; batch {inputs['batch_size']} x "
        f"{inputs['seq_len']} tokens per micro-batch",
        f"speed ({speed['source']}): student {speed['student_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, teacher "
        f"{speed['teacher_tokens_per_s_per_gpu']:,.0f}: {speed['teacher_gpus_per_student_gpu']:.3g} teacher GPUs per "
        f"student GPU",
        "memory per teacher rank, one student's request ({} usable of {:g} GiB): {}".format(
            f"{memory['usable_gib']:.1f}", inputs["gpu_mem_gib"],
            ", ".join(f"TP{t} {m['total']:.1f} GiB" for t, m in memory["one_student_request"].items())),
        f"  smallest teacher_tp that fits: {memory['min_teacher_tp'] if memory['min_teacher_tp'] else 'none'}",
    ]
    online = plan["online"]
    if "teacher_tp" not in online:
        return lines + [f"online: {online['reason']}", f"recommendation: {plan['recommendation']}"]
    if online["keeps_up"]:
        lines.append(f"online: keeps the students' wait under {MAX_WAIT_SHARE:.0%} of a step")
    else:
        lines += [f"online: no layout keeps the wait under {MAX_WAIT_SHARE:.0%}: {online['reason']}",
                  "  the most student throughput:"]
    lines += layout_lines(online)
    if plan.get("smaller_world_that_keeps_up"):
        smaller = plan["smaller_world_that_keeps_up"]
        lines += [f"  world_size={smaller['world_size']} would keep up:", summary_line(smaller),
                  f"  overrides: {smaller['overrides']}"]
    elif not online["keeps_up"]:
        lines.append("  no smaller world size keeps up either")
    cache = plan["cache"]
    lines += [
        f"cache: {cache['bytes_per_token']:.4g} B/token on disk, {count(cache['tokens_per_run'])} tokens per run -> "
        f"{size(cache['size_bytes'])}, read at {size(cache['read_bytes_per_s'])}/s by {inputs['world_size']} students",
        f"  teacher pass once: {hours(cache['teacher_pass_gpu_hours'])} GPU-hours "
        f"({hours(cache['teacher_pass_hours'])} h on {inputs['world_size']} GPUs); "
        f"then per run {hours(cache['cache_run_gpu_hours'])} GPU-hours "
        f"({hours(cache['cache_run_hours'])} h); online per run {hours(cache['online_run_gpu_hours'])} GPU-hours "
        f"({hours(cache['online_run_hours'])} h)",
        f"  {cache['planned_runs']} planned run(s): cache {hours(cache['cache_gpu_hours'])} GPU-hours, online "
        f"{hours(cache['online_gpu_hours'])} (break-even at {cache['break_even_runs']:.2f} runs)",
    ]
    if cache["writer_overrides"]:
        lines.append(f"  write it on the {inputs['world_size']} GPUs: apps.main.teacher_cache "
                     f"{cache['writer_overrides']}")
    lines.append(f"recommendation: {plan['recommendation']}")
    return lines


def is_plan_file(path: Path) -> bool:
    """Whether `path` holds a plan this planner wrote (the only kind of file `out=` replaces)."""
    try:
        existing = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(existing, dict) and existing.get("version") == PLAN_VERSION and "online" in existing


def write_plan(plan: dict, path: Path) -> None:
    """Write the JSON plan, replacing only a plan of ours: any other file at `path` is left as it is."""
    if path.exists() and not is_plan_file(path):
        raise ConfigError(f"out={path} exists and is not a plan written by apps.plan; name another file (or out=null).")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    tmp.replace(path)


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse, validate, plan, print, write; returns the plan."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(PlanArgs, argv)
    args.validate_plan()
    config_path = next((item.split("=", 1)[1] for item in argv if item.startswith("config=")), None)
    plan = Planner(args, config_path).plan()
    print("\n".join(format_plan(plan)))
    if args.out:
        write_plan(plan, Path(args.out))
        print(f"wrote {args.out}")
    return plan


if __name__ == "__main__":
    run_cli(main)
