"""The plan: `Planner` evaluates layouts of one config on one cluster, the online road and the cache road."""

import dataclasses
import math
from typing import Optional

from apps.main.teacher_cache import TeacherCacheArgs
from apps.main.transformer import num_parameters
from apps.plan.args import DTYPE_BYTES, GIB, MAX_WAIT_SHARE, PLAN_VERSION, USABLE_MEMORY, PlanArgs
from apps.plan.memory import TeacherMemory, teacher_dtype, teacher_memory
from apps.plan.sizes import read_teacher_shape, significant, student_flops_per_token, teacher_config_path
from apps.plan.evidence import SETTINGS, pilot_ce_batch, pilot_commands, pilot_gpu_hours, pilot_tokens
from apps.plan.tokenizers import command_keys, resolve_ratio, student_vocab
from apps.plan.verdict import distill_verdict, read_measurement
from apps.plan.printing import hours
from apps.plan.timing import (Layout, Speeds, Timing, candidate_layouts, max_students_per_replica,
                              tensor_parallel_sizes)
from lingua.args import to_dict
from lingua.distillation.args import WIRE_DTYPES, check_seq_len_fits_teacher
from lingua.distillation.cache.codec import planned_bytes_per_token
from lingua.distillation.outputs import TeacherOutputs
from lingua.parallel.launch_plan import LaunchPlan, TeacherLayout

# A cache shard of fewer windows than this batches the writer's forwards too finely: the plan rounds up instead.
MIN_EXACT_SHARD = 16


class Planner:
    """Evaluates layouts of one config on one cluster; `plan()` returns the JSON-able plan. A student vocabulary
    of -1 in `args` becomes its tokenizer's, as the trainer makes it: the teacher's, or with cross_tokenizer=true the
    config's own tokenizer's."""

    def __init__(self, args: PlanArgs, config_path: Optional[str] = None, overrides: tuple[str, ...] = ()):
        self.args, self.config_path, self.overrides = args, config_path, list(overrides)  # the training keys given
        teacher_config = teacher_config_path(args)
        self.shape = read_teacher_shape(teacher_config)
        # Cross-tokenizer: the teacher's tokens per student token, given, or measured here (else one sentence).
        args.teacher_tokens_per_student_token, self.ratio_source = resolve_ratio(args, teacher_config)
        # Cross-tokenizer: the teacher's rows have their own length, cut at its max positions (as the trainer says).
        check_seq_len_fits_teacher(args.data.seq_len, 0 if args.distillation.cross_tokenizer else
                                   self.shape.max_positions or 0, f"max_position_embeddings in {self.shape.path}")
        # As the trainer builds the student: its tokenizer's vocabulary, the teacher's unless cross_tokenizer=true.
        args.model = dataclasses.replace(args.model, vocab_size=student_vocab(args, self.shape.vocab))
        self.student_params = num_parameters(args.model)
        self.command_keys = command_keys(args, teacher_config)  # the teacher's path and the students' tokenizer
        kd = args.distillation
        self.bytes_up = 4 + (4 if args.model.attn_mask == "doc_causal" else 0)  # int32 tokens (+ document ids)
        self.output_vocab = self.shape.vocab if kd.cross_tokenizer else args.model.vocab_size  # the teacher's outputs
        self.bytes_down = TeacherOutputs.bytes_per_token(kd.output, kd.k, self.output_vocab,
                                                         WIRE_DTYPES[kd.wire_dtype])
        self.speeds = self.measure_or_model()
        self.prefetch = kd.prefetch
        self.tp_sizes = tensor_parallel_sizes(self.shape, args.gpus_per_node)

    def measure_or_model(self) -> Speeds:
        args = self.args
        student_flops = student_flops_per_token(args, self.student_params)
        # Speeds count student tokens: a teacher of another tokenizer runs `ratio` of its own tokens per student
        # token, in rows `ratio` times the students' length.
        ratio = args.teacher_tokens_per_student_token
        teacher_flops = ratio * self.shape.forward_flops_per_token(max(1, round(args.data.seq_len * ratio)))
        peak = args.gpu_tflops * 1e12 * args.mfu
        student = args.student_tokens_per_s or peak / student_flops
        teacher = args.teacher_tokens_per_s / ratio if args.teacher_tokens_per_s else peak / teacher_flops
        measured = [name for name in ("student", "teacher") if getattr(args, f"{name}_tokens_per_s")]
        modelled = [name for name in ("student", "teacher") if name not in measured]
        words = [f"{' and '.join(measured)} measured"] if measured else []
        if modelled:
            words.append(f"{' and '.join(modelled)} from the cost model "
                         f"({args.gpu_tflops:g} TFLOP/s x MFU {args.mfu:g})")
        if ratio != 1:
            words.append(f"the teacher at {ratio:g} of its tokens per student token ({self.ratio_source})")
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
        teachers = (TeacherLayout(layout.teacher_ranks, layout.teacher_tp, self.args.distillation.teacher_path or ""),)
        return LaunchPlan.for_launch(distributed, layout.world_size, min(self.args.gpus_per_node, layout.world_size),
                                     teachers if layout.teacher_ranks else ())

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
        timing = self.timing(layout)
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
        """GPU-hours of the online road and of the cache road for `tokens` student tokens per run. Behind a data
        wall the cache holds the unique tokens once (training from it reads them epoch after epoch), as the
        verdict counts it."""
        args, speeds, seq = self.args, self.speeds, self.args.data.seq_len
        kd = args.distillation
        # The cache writer's format (v2): its coded size as measured on the KD study's data, scaled to k and vocab.
        per_token = planned_bytes_per_token(kd.output, kd.k, self.output_vocab, DTYPE_BYTES[kd.wire_dtype], seq,
                                            wire_dtype=kd.wire_dtype)
        cached = min(tokens, math.ceil(args.unique_tokens)) if args.unique_tokens > 0 else tokens
        teacher_pass = cached / speeds.teacher / 3600
        students_only = tokens / speeds.student / 3600
        online_run = args.world_size * tokens / online["student_tokens_per_s"] / 3600
        runs = args.planned_runs
        cache_total, online_total = teacher_pass + runs * students_only, runs * online_run
        cheaper = "cache" if cache_total < online_total * (1 - MAX_WAIT_SHARE) else "online"
        road = {
            "tokens_per_run": tokens, "cached_tokens": cached, "bytes_per_token": round(per_token, 3),
            "size_bytes": round(cached * per_token),
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
        road["writer"] = self.cache_writer(cached, tokens, writer_tp) if writer_tp else None
        return road

    def cache_writer(self, cached: int, trained: int, writer_tp: int) -> dict:
        """The cache writer's layout for `cached` planned tokens: one stream per GPU (every GPU trains from the
        cache), the windows split evenly between the streams, in shards that divide a stream's windows, so that
        it writes exactly the planned tokens (rounded up to whole windows per stream only where they do not split
        evenly, or where the only shards that divide them would be tiny: `tokens` then says what it writes, and the
        writer batches its forwards by shard); `train_steps`: the steps that train the run's `trained` tokens
        from it (None where they are not whole steps)."""
        args, streams, seq = self.args, self.args.world_size, self.args.data.seq_len
        per_stream = -(-math.ceil(cached / seq) // streams)
        default_shard = TeacherCacheArgs.shard_sequences
        shard = max(d for d in range(1, min(default_shard, per_stream) + 1) if per_stream % d == 0)
        if shard < MIN_EXACT_SHARD <= per_stream:  # no divisor near a full shard: whole shards, a few windows more
            shard, per_stream = default_shard, -(-per_stream // default_shard) * default_shard
        step_tokens = args.grad_acc_steps * args.data.batch_size * seq * streams
        return {"teacher_tp": writer_tp, "streams": streams, "sequences_per_stream": per_stream,
                "shard_sequences": shard, "tokens": streams * per_stream * seq,
                "train_steps": trained // step_tokens if trained % step_tokens == 0 else None,
                "overrides": f"distillation.teacher_tp={writer_tp} streams={streams} "
                             f"sequences_per_stream={per_stream} shard_sequences={shard}"}

    def facts(self) -> dict:
        """What the plan rests on: the inputs, both models' sizes, the speeds and the memory at each teacher_tp."""
        args, shape, speeds = self.args, self.shape, self.speeds
        distillation = to_dict(args.distillation)
        return {
            "version": PLAN_VERSION,
            "inputs": {"config": self.config_path, "overrides": self.overrides, "world_size": args.world_size,
                       "gpus_per_node": args.gpus_per_node,
                       "gpu_mem_gib": args.gpu_mem_gib, "teacher_config": shape.path,
                       "teacher_tokens_per_s": args.teacher_tokens_per_s,
                       "student_tokens_per_s": args.student_tokens_per_s,
                       "teacher_tokens_per_student_token": args.teacher_tokens_per_student_token,
                       "gpu_tflops": args.gpu_tflops,
                       "mfu": args.mfu, "planned_runs": args.planned_runs, "teacher_dtype": teacher_dtype(args),
                       "batch_size": args.data.batch_size, "seq_len": args.data.seq_len, "steps": args.steps,
                       "grad_acc_steps": args.grad_acc_steps, "prefetch": self.prefetch,
                       "teacher_keys": self.command_keys["teacher"], "tokenizer_keys": self.command_keys["tokenizer"],
                       "notes": self.command_keys["notes"],
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

    def verdict(self, tokens: int, road: str, facts: dict) -> dict:
        """Should this run distill at all: the teacher's overhead against the multiplier a study measured, what of
        the plan that study did not measure, and the pilot that would."""
        args, kd = self.args, self.args.distillation
        measured = read_measurement(args.kd_measurement, kd.output,
                                    tokens / args.unique_tokens if args.unique_tokens else 1.0, args.unique_tokens)
        settings = {name: getattr(kd, name) for name in SETTINGS} | {"vocab": args.model.vocab_size}
        verdict = distill_verdict(facts["teacher"]["forward_flops_per_token"],
                                  facts["student"]["train_flops_per_token"], tokens, args.unique_tokens,
                                  args.planned_runs, road, measured, self.student_params, self.shape.parameters(),
                                  args.repeat_decay, settings,
                                  pilot_tokens(facts["inputs"], facts["online"], args.steps))
        if verdict["unmeasured"]:
            verdict["pilot"] = pilot_commands(facts["inputs"], facts["online"], args.dump_dir, args.steps)
            verdict["pilot_gpu_hours"] = significant(pilot_gpu_hours(facts["inputs"], facts["online"], args.steps,
                                                                     self.speeds.student))
            verdict["pilot_equal_global_batch"] = bool(pilot_ce_batch(facts["inputs"], facts["online"]))
        return verdict

    def road_words(self, result: dict, road: str, waiting: str) -> str:
        """A road in a phrase: its layout and its GPU-hours (the other road's for comparison)."""
        online, cache, world = result["online"], result["cache"], self.args.world_size
        if road == "cache":
            writer = cache["writer"]
            by = f" with teacher_tp={writer['teacher_tp']}" if writer else ""
            return (f"from a cache (written once{by}: "
                    f"{hours(cache['teacher_pass_gpu_hours'])} GPU-hours; then {hours(cache['cache_run_gpu_hours'])} "
                    f"a run on {world} GPUs; online {hours(cache['online_run_gpu_hours'])} a run)")
        return (f"online with teacher_tp={online['teacher_tp']} x {online['replicas']} replica(s) beside "
                f"{online['students']} students ({hours(cache['online_run_gpu_hours'])} GPU-hours a run"
                + (f", {waiting}" if waiting else "") + f"; from a cache {hours(cache['cache_gpu_hours'])})")

    def answer(self, result: dict, waiting: str) -> str:
        """The plan in one sentence, its first line: distill or not, on which road and layout, the break-even, the
        GPU-hours, and where the plan is not measured, the pilot first and its GPU-hours. The lines below it are
        its evidence; none of them recommends anything else."""
        cache, verdict = result["cache"], result["verdict"]
        needed, worth, cheaper = verdict["needed_on_road"], verdict["worth"], cache["cheaper"]
        even = f"break-even {needed:.3g}x the CE tokens"
        if not verdict["measured_here"]:
            if verdict["pays_on"] == cheaper:
                nearest = f"distill unless the pilot measures {needed:.3g}x or less"
            else:
                nearest = f"do not distill unless the pilot measures more than {needed:.3g}x"
            return (f"pilot first ({hours(verdict['pilot_gpu_hours'])} GPU-hours, commands below): {even}, the "
                    f"nearest measurement {worth:.3g}x, so {nearest}; to distill: "
                    f"{self.road_words(result, cheaper, waiting)}")
        if verdict["pays_on"] == cheaper:
            return f"distill {self.road_words(result, cheaper, waiting)}: {even}, measured {worth:.3g}x"
        if verdict["pays_on"] == "cache":  # online is cheaper in GPU-hours, but its teacher is not paid back
            return (f"distill {self.road_words(result, 'cache', waiting)}: online costs fewer GPU-hours but does "
                    f"not pay back its teacher ({even} online, measured {worth:.3g}x)")
        shared = f"; a cache shared by {verdict['min_cache_runs']} runs would pay" if verdict["min_cache_runs"] else ""
        return (f"do not distill: train CE-only on all {self.args.world_size} GPUs "
                f"({hours(cache['cache_run_gpu_hours'])} GPU-hours a run); {even} "
                f"{'from a cache' if cheaper == 'cache' else 'online'} (the cheaper road), measured {worth:.3g}x"
                f"{shared}")

    def global_batch(self, online: dict) -> dict:
        """Tokens a step distilling (the students only: data.batch_size is per student rank) and CE-only on every
        GPU at the same data.batch_size."""
        args = self.args
        per_rank = args.grad_acc_steps * args.data.batch_size * args.data.seq_len
        return {"students": online["students"], "per_student_rank": per_rank,
                "distilling": online["students"] * per_rank, "ce_only": args.world_size * per_rank}

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
        result["global_batch"] = self.global_batch(online)
        result["verdict"] = self.verdict(tokens, cache["cheaper"], result)
        waiting = "" if reason is None else f"students waiting {online['wait_share']:.0%} of each step"
        result["recommendation"] = self.answer(result, waiting)
        return result
