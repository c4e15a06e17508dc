"""The `distillation:` config section (DistillationArgs, TeacherArgs: one teacher is a list of one), the keys and
titles a sentence names a teacher by, the teacher-directory hints, the look-ahead and the KD weight's schedule."""

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import torch

from lingua.args import require, require_filled
from lingua.distillation.loss.divergences import DIVERGENCES
from lingua.distillation.loss.fused import WEIGHT_GRADS
from lingua.distillation.outputs import FORMATS
from lingua.errors import PeerStopped, TeacherError
from lingua.parallel.collectives import AgreedError
from lingua.parallel.launch_plan import teacher_rank_count

MAX_PREFETCH = 2  # requests ahead; more only holds more response buffers without hiding more
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TEACHER_DTYPES = ("auto", "bf16", "fp32", "fp16")
SOURCES = ("online", "cache")
ALPHA_SCHEDULES = ("constant", "lr")


class AgreedPeerStopped(PeerStopped, AgreedError):
    """A teacher's bug (its traceback is in its own log) or another bridge's failed teacher, agreed on by the
    students like `AgreedTeacherError`, and reported like any peer that stopped first."""


class AgreedTeacherError(TeacherError, AgreedError):
    """A teacher's failure the students agreed on at a step's control point: raised on every student at once, so
    each first completes its posted requests and tells its own teacher (ERROR) before leaving."""


@dataclass
class TeacherArgs:
    """A teacher of `distillation.teachers`: its checkpoint and its own ranks, or its cache; its share
    of the KD term, its tokenizer, the data sources it teaches, and optionally (online) its own dtype and tensor
    parallelism. The other distillation settings are shared by all teachers."""

    path: Optional[str] = None  # local directory (or hub id) of a transformers causal LM
    # Instead of path: the folder of a cache written from this teacher by apps.main.teacher_cache (no teacher ranks)
    cache_dir: Optional[str] = None
    n_teacher_ranks: int = 1  # its ranks, laid out after the students and the teachers before it
    weight: float = 1.0  # its share of each position's KD term (normalised over the teachers of the position)
    cross_tokenizer: bool = False  # its tokenizer is not the students' (see DistillationArgs.cross_tokenizer)
    tokenizer: Optional[str] = None  # its Hugging Face tokenizer directory with cross_tokenizer; None = path
    sources: list[str] = field(default_factory=list)  # the data.sources it teaches; [] = every source
    teacher_dtype: Optional[str] = None  # its load dtype (as distillation.teacher_dtype); None = that shared value
    teacher_tp: Optional[int] = None  # ranks per replica of it (as distillation.teacher_tp); None = that shared value


@dataclass
class DistillationArgs:
    teacher_path: Optional[str] = None  # local directory (or hub id when online) of a transformers causal LM
    n_teacher_ranks: int = 1  # ranks that run the teacher (the last ones by default); the rest are students
    # Ranks per teacher replica: the teacher sharded tensor-parallel over them (on one node); n_teacher_ranks is a
    # multiple of it, and its attention and KV head counts divide by it.
    teacher_tp: int = 1
    output: str = "topk"  # "topk" | "sampled" | "full"
    k: int = 64  # top-k ids, or samples per position for "sampled"
    temperature: float = 1.0  # softmax temperature T of teacher and student in the KD term (1 = as they are)
    alpha: float = 0.5  # loss = (1 - alpha) * CE + alpha * T^2 * KD
    alpha_schedule: str = "constant"  # "constant" | "lr" (alpha follows the lr schedule's factor)
    divergence: str = "fkl"  # "fkl" | "rkl" | "jsd"
    jsd_beta: float = 0.5  # divergence=jsd: the mixture's weight on the teacher (0.5 = symmetric)
    teacher_dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bf16" | "fp32" | "fp16"
    # The teacher's attention in transformers (sdpa, eager, flash_attention_2, ...); null = the model's default.
    attn_implementation: Optional[str] = "sdpa"
    wire_dtype: str = "bf16"  # dtype of the values sent to students: "bf16" | "fp16" | "fp32"
    # The student's CE + KD computed fused with its output head (lingua/distillation/loss/fused.py: no [tokens, vocab]
    # logits, KD at T = 1 in CE's own passes); false = logits, then CE and the chunked kd_loss on them.
    fused_loss: bool = True
    loss_chunk_size: int = 0  # positions per chunk of the student's loss; 0 = auto (fused: a memory budget; else 1024)
    # The fused loss's head gradient: "accumulate" (an fp32 [V, D] sum over the chunks) or "vocab_blocks" (written
    # one vocabulary block at a time after the chunks, logits recomputed: less memory, one more head GEMM).
    loss_weight_grad: str = "accumulate"
    # The fused loss's chunk math through torch.compile (lingua/distillation/loss/compiled_chunk.py: inductor fuses its
    # passes over [tokens, vocab]; Triton on CUDA, C++ on CPU); one compile per process. "auto": the CE-only loss on
    # a GPU (measured on an H100: 0.48-0.72x eager's time at no more memory), eager with a teacher (faster compiled,
    # but 1.2-1.4x the peak) and on the CPU (slower compiled); true / false: always / never.
    loss_compile: Union[bool, str] = "auto"
    # PaLM's z-loss: this weight * logsumexp(student logits)^2 per position with a label, averaged like CE, with or
    # without a teacher, logged as loss/z (docs/research_loss.md); 0 = off, 1e-4 = PaLM's and OLMo 2's value.
    z_loss: float = 0.0
    # Teacher rows per lm_head chunk (bounds the teacher's logits memory); 0 = auto: 4 on CPU, on GPU from the memory
    # free after loading the teacher.
    logits_chunk_rows: int = 0
    seed: int = 0  # for the "sampled" output
    # Where the teacher's outputs come from: "online" (teacher ranks, the bridge) or "cache" (an offline cache
    # written by apps.main.teacher_cache into cache_dir; every rank is a student, the cache is the dataset).
    source: str = "online"
    cache_dir: Optional[str] = None  # with source=cache: the folder apps.main.teacher_cache wrote
    # Teacher requests submitted ahead of the micro-batch being computed (0 = each right before its own
    # forward), across step boundaries: with 1 the teacher's forward hides behind the student's whole step.
    # "auto": 1 where it can (each rank its own GPU, or the node's cores enough for its ranks), else 0.
    prefetch: Union[int, str] = "auto"
    # A teacher whose tokenizer is not the student's (lingua/distillation/cross_tokenizer/): the teacher rank reads
    # the students' windows as text, tokenizes it with its own tokenizer, and sends its top-k back in the students'
    # positions and ids with a per-position KD weight (0 where no teacher token starts where the student's does);
    # the cache writer does the same and stores those targets (a cache of one student tokenizer).
    cross_tokenizer: bool = False
    teacher_tokenizer: Optional[str] = None  # the teacher's Hugging Face tokenizer directory; None = teacher_path
    # Cross-tokenizer only: > 0 adds Universal Logit Distillation for the teacher's unmapped mass (its top-k ids that
    # are no student token), weighted by this against the KD (lingua/distillation/loss/uld.py); 0 = off, the rest bucket
    # alone.
    uld_weight: float = 0.0
    uld_k: int = 16  # with uld_weight > 0: how many sorted probabilities (teacher unmapped, student rest) ULD compares
    # The teachers, each on its own ranks or from its own cache (instead of teacher_path, n_teacher_ranks,
    # cross_tokenizer, teacher_tokenizer and cache_dir, which spell a list of one): the students mix their KD terms by
    # weight and per data source (lingua/distillation/loss/mixture.py). Validation reads those keys into this list;
    # every road after it reads the list. One element without sources is the same run as teacher_path.
    teachers: list[TeacherArgs] = field(default_factory=list)

    def compiles_loss(self, with_teacher: bool, device: torch.device) -> bool:
        """Whether the fused loss's chunk math runs compiled (`loss_compile`; "auto": CE alone, on a GPU)."""
        if self.loss_compile == "auto":
            return not with_teacher and device.type == "cuda" and self.fused_loss
        return self.loss_compile

    def validate(self, enabled: bool = True) -> None:
        """Every value is checked (a typo stays an error with distillation off); the source, the teacher count
        and the teacher path or cache directory only matter with it on."""
        for key, allowed in (("output", FORMATS), ("divergence", DIVERGENCES), ("alpha_schedule", ALPHA_SCHEDULES),
                             ("teacher_dtype", TEACHER_DTYPES), ("wire_dtype", tuple(WIRE_DTYPES)),
                             ("source", SOURCES), ("loss_weight_grad", WEIGHT_GRADS)):
            require(getattr(self, key) in allowed, f"distillation.{key}", getattr(self, key),
                    f"use one of {', '.join(allowed)}")
        require(isinstance(self.fused_loss, bool), "distillation.fused_loss", self.fused_loss, "use true or false")
        require(isinstance(self.loss_compile, bool) or self.loss_compile == "auto", "distillation.loss_compile",
                self.loss_compile, "use auto, true or false")
        require(self.loss_compile is not True or self.fused_loss, "distillation.loss_compile", self.loss_compile,
                "it compiles the fused loss's chunk math; set distillation.fused_loss=true or loss_compile=auto")
        require(self.output != "sampled" or self.divergence == "fkl", "distillation.divergence", self.divergence,
                "distillation.output=sampled estimates the forward KL only; set distillation.divergence=fkl")
        require(self.divergence != "jsd" or 0.0 < self.jsd_beta < 1.0, "distillation.jsd_beta", self.jsd_beta,
                "with distillation.divergence=jsd use a value strictly between 0 and 1")
        require(0.0 <= self.alpha <= 1.0, "distillation.alpha", self.alpha, "use a weight in [0, 1]")
        require(math.isfinite(self.temperature) and self.temperature > 0, "distillation.temperature",
                self.temperature, "use a positive temperature (1.0 = the teacher's own distribution)")
        require(self.output == "full" or self.k >= 1, "distillation.k", self.k,
                "use a positive number of ids (or samples) per position")
        require(isinstance(self.z_loss, (int, float)) and math.isfinite(self.z_loss) and self.z_loss >= 0,
                "distillation.z_loss", self.z_loss, "use a finite weight >= 0 (0 = off; 1e-4 is PaLM's value)")
        require(self.loss_chunk_size >= 0, "distillation.loss_chunk_size", self.loss_chunk_size,
                "use 0 (auto) or a positive number of positions per chunk")
        require(self.logits_chunk_rows >= 0, "distillation.logits_chunk_rows", self.logits_chunk_rows,
                "use 0 (auto: from the memory free on the teacher's GPU, 4 on CPU) or a positive number of rows")
        require(self.prefetch == "auto" or (type(self.prefetch) is int and 0 <= self.prefetch <= MAX_PREFETCH),
                "distillation.prefetch", self.prefetch, f"use auto, 0 (no look-ahead), 1 or {MAX_PREFETCH}")
        require(self.teacher_tp >= 1, "distillation.teacher_tp", self.teacher_tp,
                "use 1 (one rank per teacher) or the number of ranks to shard each teacher over")
        require(isinstance(self.cross_tokenizer, bool), "distillation.cross_tokenizer", self.cross_tokenizer,
                "use true or false")
        self.validate_cross_tokenizer()
        require(isinstance(self.uld_weight, (int, float)) and math.isfinite(self.uld_weight) and self.uld_weight >= 0,
                "distillation.uld_weight", self.uld_weight, "use a finite weight >= 0 (0 = no ULD term)")
        require(type(self.uld_k) is int and self.uld_k >= 1, "distillation.uld_k", self.uld_k,
                "use a positive number of sorted probabilities to compare")
        if self.uld_weight > 0:
            require(self.cross_tokenizer or any(t.cross_tokenizer for t in self.teachers), "distillation.uld_weight",
                    self.uld_weight, "ULD matches the mass a teacher of another tokenizer cannot map; set "
                    "distillation.cross_tokenizer=true (with several teachers, on one of them), or uld_weight=0")
            require(self.output == "topk", "distillation.output", self.output,
                    "ULD compares the teacher's unmapped top-k entries, which sampled outputs do not carry; set "
                    "distillation.output=topk, or uld_weight=0")
            require(self.loss_compile is not True, "distillation.loss_compile", self.loss_compile,
                    "ULD runs in the eager chunk math; set distillation.loss_compile=auto, or uld_weight=0")
        if not enabled:
            return
        if not self.spelled_by_keys:
            return self._validate_teachers()
        self._validate_lone_teacher()
        self.teachers = [self.lone_teacher()]  # one teacher is a list of one: every road reads `teachers`

    @property
    def spelled_by_keys(self) -> bool:
        """Whether the teacher is named by the one-teacher keys (teacher_path or cache_dir, ...) rather than listed:
        no list, or (a validated config read again) the list of one those keys made."""
        named = bool(self.teacher_path or self.cache_dir)
        return not self.teachers or (named and self.teachers == [self.lone_teacher()])

    def _validate_lone_teacher(self) -> None:
        """One teacher (teacher_path and its keys): its cache, or its ranks and checkpoint."""
        if self.source == "cache":  # the cache holds the teacher's outputs: no teacher ranks, no teacher_path
            require(bool(self.cache_dir), "distillation.cache_dir", self.cache_dir,
                    "distillation.source=cache needs the folder of a cache written by apps.main.teacher_cache")
            return
        teacher_rank_count(True, self.n_teacher_ranks)
        require(self.n_teacher_ranks % self.teacher_tp == 0, "distillation.n_teacher_ranks", self.n_teacher_ranks,
                f"each teacher replica is distillation.teacher_tp={self.teacher_tp} ranks; use a multiple of it")
        require(bool(self.teacher_path), "distillation.teacher_path", self.teacher_path,
                "distillation is on: point it at a transformers checkpoint directory, or set "
                "enable_distillation=false")
        _check_teacher_dir(self.teacher_path, "distillation.teacher_path")

    def lone_teacher(self) -> TeacherArgs:
        """The one teacher of teacher_path and its keys, as an element of `teachers` (its cache with source=cache)."""
        cached = self.source == "cache"
        return TeacherArgs(path=None if cached else self.teacher_path, cache_dir=self.cache_dir if cached else None,
                           n_teacher_ranks=self.n_teacher_ranks, cross_tokenizer=self.cross_tokenizer,
                           tokenizer=self.teacher_tokenizer)

    def online_teachers(self) -> list[int]:
        """The indices of the teachers that run on ranks of their own (no cache_dir), in rank order."""
        return [i for i, teacher in enumerate(self.teachers) if not teacher.cache_dir]

    def _refuse_shared_keys(self, index: str) -> None:
        """The one-teacher keys that `teachers` sets per teacher (teachers[`index`]): beside it, one is ignored."""
        require(not self.cross_tokenizer, "distillation.cross_tokenizer", self.cross_tokenizer,
                f"with distillation.teachers set cross_tokenizer per teacher (teachers[{index}].cross_tokenizer)")
        require(self.n_teacher_ranks == 1, "distillation.n_teacher_ranks", self.n_teacher_ranks,
                "with distillation.teachers set it per teacher (teachers[i].n_teacher_ranks), or remove it")
        require(self.teacher_tokenizer is None, "distillation.teacher_tokenizer", self.teacher_tokenizer,
                "with distillation.teachers set it per teacher (teachers[i].tokenizer), or remove it")
        require(not self.cache_dir, "distillation.cache_dir", self.cache_dir,
                f"with distillation.teachers name each teacher's cache (teachers[{index}].cache_dir), or remove it")

    def _validate_teachers(self) -> None:
        """The listed teachers: each its path, ranks and weight; the keys of the one-teacher case left unset."""
        require(not self.teacher_path, "distillation.teacher_path", self.teacher_path,
                "distillation.teachers names the teachers; set teacher_path=null or remove distillation.teachers")
        self._refuse_shared_keys("0" if len(self.teachers) == 1 else "i")
        self._settle_teachers_source()
        for i, teacher in enumerate(self.teachers):
            key = f"distillation.teachers[{i}]"
            require(not (teacher.path and teacher.cache_dir), f"{key}.cache_dir", teacher.cache_dir,
                    "a teacher runs online (path, on its own ranks) or from its cache (cache_dir); remove one of them")
            if teacher.cache_dir:  # a cache's settings are in its manifest, checked when the students open it
                for own in ("teacher_dtype", "teacher_tp"):
                    require(getattr(teacher, own) is None, f"{key}.{own}", getattr(teacher, own),
                            "a teacher read from its cache runs on no ranks: its outputs were computed in the dtype "
                            "and layout its cache was written with; remove the key")
            else:
                require(bool(teacher.path), f"{key}.path", teacher.path,
                        "point it at a transformers checkpoint directory, or name its cache (cache_dir)")
                _check_teacher_dir(teacher.path, f"{key}.path")
                self.validate_teacher_ranks(i)
            require(math.isfinite(teacher.weight) and teacher.weight > 0, f"{key}.weight", teacher.weight,
                    "use a positive share of the KD term (weights are normalised over a position's teachers)")
            require(isinstance(teacher.cross_tokenizer, bool), f"{key}.cross_tokenizer", teacher.cross_tokenizer,
                    "use true or false")
            if teacher.cross_tokenizer:
                self.teacher_args(i).validate_cross_tokenizer(key, tp_setting(self, i))

    def validate_teacher_ranks(self, index: int) -> None:
        """Online teacher `index`'s own dtype and tp, and its ranks: whole replicas of its teacher_tp."""
        teacher, key = self.teachers[index], f"distillation.teachers[{index}]"
        _check_own_settings(teacher, key)
        tp, tp_key = self.teacher_args(index).teacher_tp, tp_setting(self, index)
        require(teacher.n_teacher_ranks >= 1 and teacher.n_teacher_ranks % tp == 0,
                f"{key}.n_teacher_ranks", teacher.n_teacher_ranks, f"use a positive multiple of {tp_key}={tp}")

    def _settle_teachers_source(self) -> None:
        """Teachers all from caches train on source=cache (no teacher ranks); with any online, source=online (the
        online ones on their ranks, the cached ones' targets with the batches)."""
        if all(t.cache_dir for t in self.teachers):
            self.source = "cache"
            return
        require(self.source == "online", "distillation.source", self.source,
                "with distillation.teachers every teacher names its cache (teachers[i].cache_dir) to train from "
                "caches; set source=online to run them on their own ranks")

    def validate_cross_tokenizer(self, key: str = "distillation", tp_key: str = "distillation.teacher_tp") -> None:
        """A cross-tokenizer teacher sends a sparse format: top-k (at any tensor parallelism) or sampled (unsharded;
        `tp_key`: the key that sets its tensor parallelism)."""
        if self.cross_tokenizer:
            require(self.output != "full", "distillation.output", self.output,
                    f"the full format is the teacher's log-probs over the student's vocabulary, which a teacher of "
                    f"another tokenizer ({key}.cross_tokenizer=true) cannot give; set output=topk or output=sampled")
            require(self.teacher_tp == 1 or self.output == "topk", tp_key, self.teacher_tp,
                    f"{key}.cross_tokenizer=true with output=sampled draws from the teacher's probabilities added up "
                    f"per student id over its whole vocabulary, of which a tensor-parallel rank holds a slice; set "
                    f"{tp_key.removeprefix('distillation.')}=1, or output=topk")

    def teacher_args(self, index: int) -> "OneTeacherArgs":
        """The settings teacher `index` of `teachers` runs with: these, its own path, ranks and tokenizer (one named by
        the one-teacher keys keeps their names: index None)."""
        teacher = self.teachers[index]
        shared = {f.name: getattr(self, f.name) for f in fields(DistillationArgs)}
        shared.update(teacher_path=teacher.path, n_teacher_ranks=teacher.n_teacher_ranks, teachers=[],
                      cross_tokenizer=teacher.cross_tokenizer, teacher_tokenizer=teacher.tokenizer,
                      cache_dir=teacher.cache_dir)
        for key in ("teacher_dtype", "teacher_tp"):  # its own where set, else the shared value
            if getattr(teacher, key) is not None:
                shared[key] = getattr(teacher, key)
        return OneTeacherArgs(**shared, index=None if self.spelled_by_keys else index,
                              own_dtype=teacher.teacher_dtype is not None)


@dataclass
class OneTeacherArgs(DistillationArgs):
    """The settings of teacher `index` of `teachers` (`DistillationArgs.teacher_args`): what its bridge, client and
    server read; their sentences name it by index and path."""

    index: Optional[int] = 0  # None: the teacher of the one-teacher keys, named as teacher_path's
    own_dtype: bool = False  # its teacher_dtype is its own (teachers[index].teacher_dtype), not the shared one


def tp_setting(args: DistillationArgs, index: int) -> str:
    """The key that sets teacher `index`'s tensor parallelism: its own teacher_tp, or the shared one."""
    own = args.teachers[index].teacher_tp is not None
    return f"distillation.teachers[{index}].teacher_tp" if own else "distillation.teacher_tp"


def dtype_setting(args: DistillationArgs) -> str:
    """The key that sets a teacher's dtype: teacher `index`'s own teacher_dtype (a listed teacher), or the shared."""
    own = isinstance(args, OneTeacherArgs) and args.own_dtype and args.index is not None
    return f"distillation.teachers[{args.index}].teacher_dtype" if own else "distillation.teacher_dtype"


def teacher_title(args: DistillationArgs, rank: int) -> str:
    """How a sentence names a teacher rank: "Teacher rank 2", or a listed one "Teacher 1 (<path>) on rank 4"."""
    if isinstance(args, OneTeacherArgs) and args.index is not None:
        return f"Teacher {args.index} ({args.teacher_path}) on rank {rank}"
    return f"Teacher rank {rank}"


def _check_own_settings(teacher: TeacherArgs, key: str) -> None:
    """A teacher's own teacher_dtype and teacher_tp, where set, are values the shared keys take."""
    require(teacher.teacher_dtype in (None, *TEACHER_DTYPES), f"{key}.teacher_dtype", teacher.teacher_dtype,
            f"use one of {', '.join(TEACHER_DTYPES)}, or null for distillation.teacher_dtype")
    require(teacher.teacher_tp is None or (type(teacher.teacher_tp) is int and teacher.teacher_tp >= 1),
            f"{key}.teacher_tp", teacher.teacher_tp, "use 1 (one rank per replica), the number of ranks to shard "
            "this teacher over, or null for distillation.teacher_tp")


def _check_teacher_dir(path: str, key: str) -> None:
    """A path written as one (absolute, ./, ../, ~) cannot be a hub id: refuse it now, not at the handshake."""
    require_filled(key, path, "the teacher's transformers checkpoint directory (the one holding its config.json)")
    looks_local = path.startswith(("/", ".", "~"))
    require(not looks_local or Path(path).expanduser().exists(), key, path,
            f"that directory does not exist{close_names(path)}; {teacher_dir_fix(path)}")


DEMO_TEACHERS = Path("data") / "teachers"  # where setup.prepare_teacher and setup.make_tiny_teacher write


def close_names(path: str) -> str:
    """", did you mean X or Y (in its folder)?" for the entries of a missing `path`'s folder whose names are close
    to its own (difflib), ", nor does its folder F" where that is missing too, else ""."""
    import difflib

    local = Path(path).expanduser()
    folder = local.parent
    if not folder.is_dir():
        return f", nor does its folder {folder}" if str(folder) not in ("", ".") else ""
    try:
        names = [entry.name for entry in folder.iterdir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(local.name, names, n=3, cutoff=0.6)
    close += [name for name in names if name.lower() == local.name.lower() and name not in close]  # case only
    if not close:
        return ""
    return f", did you mean {' or '.join(str(folder / name) for name in close[:3])}?"


def teacher_dir_fix(path: str, key: str = "it") -> str:
    """What to do about a teacher directory that is missing or unusable: point at a checkpoint directory, and only
    for a path under data/teachers/ (where the demo's teachers live) the commands that make one there; anywhere else
    they would write a toy model where the user's own teacher was meant to be. `key`: the setting to point."""
    fix = f"point {key} at a transformers checkpoint directory"
    parts = Path(path).expanduser().parts
    under_demo = any(parts[i:i + 2] == DEMO_TEACHERS.parts for i in range(len(parts) - 1)) and len(parts) > 2
    if under_demo:
        fix += (f", or make one: `python -m setup.prepare_teacher --out {path}` (SmolLM2-135M-Instruct, the demo "
                f"teacher) or `python -m setup.make_tiny_teacher --out {path}` (the tiny test teacher)")
    return fix


def check_seq_len_fits_teacher(seq_len: int, max_positions: int, where: str) -> None:
    """Students' sequences must fit the teacher's positions (0 = unknown: nothing to check)."""
    require(not 0 < max_positions < seq_len, "data.seq_len", seq_len,
            f"the teacher supports at most {max_positions} positions ({where}); set data.seq_len <= {max_positions}")


def resolve_prefetch(prefetch: Union[int, str], device_type: str, ranks_on_node: int, threads_per_rank: int,
                     cores: int) -> tuple[int, str]:
    """(look-ahead, why) for distillation.prefetch. "auto" is 1 where the teacher's forward can run beside the
    students' compute: every rank on its own GPU, or the node's ranks times their threads within its cores. On
    oversubscribed cores it is 0: the look-ahead would only make the teacher take cores from the students
    (measured on the 2-core demo, 3 ranks: 2m19s with 0, 3m09s with 1)."""
    if prefetch != "auto":
        return prefetch, f"distillation.prefetch={prefetch}"
    if device_type == "cuda":
        return 1, "auto: every rank has its own GPU"
    demand = f"{ranks_on_node} ranks x {threads_per_rank} threads on {cores} cores"
    if ranks_on_node * threads_per_rank <= cores:
        return 1, f"auto: {demand}, the teacher computes beside the students"
    return 0, f"auto: {demand} oversubscribe them, a look-ahead would take cores from the students"


def alpha_at(step: int, alpha: float, schedule: str, lr_factor: float) -> float:
    """KD weight at `step`: constant, or "lr" = alpha times the lr schedule's current factor."""
    assert schedule in ALPHA_SCHEDULES, schedule  # DistillationArgs.validate() names the choices
    return alpha * lr_factor if schedule == "lr" else alpha
