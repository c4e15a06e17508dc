"""Bad configurations and what each must say: one table for the in-process check of every rule
(tests/unit/lingua/parallel/test_launch_plan.py) and, for the few rows marked `launch` (one per way a launch is refused), the
real torchrun path (tests/dist/test_bad_config.py: 2 ranks, and 2 students + 1 tiny teacher).

Each row's overrides go on top of the tiny standard runs (`tests.runs.base_overrides` /
`distill_overrides`), so the rest of the config is valid; `{teacher}` stands for the tiny teacher's
directory. `key` must be named in the message; `sentence`, when given, is the whole message.
"""

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class BadConfig:
    name: str
    overrides: dict
    key: str  # the setting the message must name
    # the exact message, when pinned; one per launch ("plain", "distill") where it names a launch of that size
    sentence: Optional[Union[str, dict]] = None
    launch: bool = False  # also launched under torchrun (plain and distillation): a few representative rows

    def sentence_of(self, launch: str) -> Optional[str]:
        return self.sentence[launch] if isinstance(self.sentence, dict) else self.sentence

    def args(self, teacher: str = "") -> list[str]:
        return [f"{k}={str(v).replace('{teacher}', teacher)}" for k, v in self.overrides.items()]


BAD_CONFIGS = [
    # The cases: once found only after the teacher had loaded (or never).
    BadConfig("negative_lr", {"optim.lr": "-1e-3"}, "optim.lr", "optim.lr=-0.001; use a positive learning rate.",
              launch=True),
    BadConfig("zero_batch", {"data.batch_size": 0}, "data.batch_size", "data.batch_size=0; use a positive number."),
    BadConfig("activation_checkpointing", {"distributed.activation_checkpointing": "bogus"},
              "distributed.activation_checkpointing",
              "distributed.activation_checkpointing='bogus'; use one of none, full, selective."),
    BadConfig("model_dtype", {"distributed.model_dtype": "fp8"}, "distributed.model_dtype",
              "distributed.model_dtype='fp8'; use one of bf16, fp32."),
    BadConfig("jsd_beta", {"distillation.jsd_beta": 1.5, "distillation.divergence": "jsd"}, "distillation.jsd_beta",
              "distillation.jsd_beta=1.5; with distillation.divergence=jsd use a value strictly between 0 and 1."),
    BadConfig("alpha_schedule", {"distillation.alpha_schedule": "cosine"}, "distillation.alpha_schedule",
              "distillation.alpha_schedule='cosine'; use one of constant, lr."),
    BadConfig("teacher_dtype", {"distillation.teacher_dtype": "int8"}, "distillation.teacher_dtype",
              "distillation.teacher_dtype='int8'; use one of auto, bf16, fp32, fp16."),
    BadConfig("zero_teacher_ranks", {"enable_distillation": "true", "distillation.n_teacher_ranks": 0},
              "distillation.n_teacher_ranks", "distillation.n_teacher_ranks=0; distillation needs at least one teacher "
              "rank; use 1 or more, or set enable_distillation=false."),
    BadConfig("debug_mode", {"distributed.debug": "verbose"}, "distributed.debug",
              "distributed.debug='verbose'; use false, trace (flight recorder dumps and per-collective logs, for "
              "hangs), detail (TORCH_DISTRIBUTED_DEBUG=DETAIL, for mismatched collectives) or true (both)."),
    BadConfig("negative_timeout", {"distributed.train_timeout_s": -1}, "distributed.train_timeout_s",
              "distributed.train_timeout_s=-1.0; use a positive number of seconds (at most 604800, a week)."),
    # Unknown keys, at three levels, and wrong types.
    BadConfig("unknown_top_key", {"stepz": 3}, "stepz"),
    BadConfig("unknown_section_key", {"optim.lrr": 1}, "optim.lrr", launch=True),
    BadConfig("unknown_nested_key", {"data.tokenizer.nam": "hf"}, "data.tokenizer.nam"),
    BadConfig("string_for_int", {"steps": "many"}, "steps", "Invalid value for steps: Value 'many' of type 'str' "
              "could not be converted to Integer; set steps to an integer."),
    BadConfig("float_for_int", {"model.dim": 1.5}, "model.dim"),
    BadConfig("dict_in_weights", {"data.sources": "{text: {a: 1}}"}, "data.sources"),
    BadConfig("not_a_bool", {"enable_distillation": "maybe"}, "enable_distillation"),
    BadConfig("list_for_section", {"model": "[1, 2]"}, "model"),
    # Ranges and cross-field rules, section by section.
    BadConfig("zero_steps", {"steps": 0}, "steps"),
    BadConfig("zero_grad_acc", {"grad_acc_steps": 0}, "grad_acc_steps"),
    BadConfig("empty_dump_dir", {"dump_dir": "''"}, "dump_dir"),
    BadConfig("dump_dir_is_a_file", {"dump_dir": "{teacher}/config.json"}, "dump_dir"),
    BadConfig("dump_dir_under_a_file", {"dump_dir": "{teacher}/config.json/run"}, "dump_dir"),
    BadConfig("probe_freq", {"probe_freq": 0}, "probe_freq"),
    BadConfig("exit_after_steps", {"exit_after_steps": 0}, "exit_after_steps"),
    BadConfig("grace", {"preemption_grace_s": -1}, "preemption_grace_s"),
    BadConfig("heads_do_not_divide_dim", {"model.n_heads": 3}, "model.n_heads"),
    BadConfig("kv_heads", {"model.n_kv_heads": 3}, "model.n_kv_heads"),
    BadConfig("odd_head_dim", {"model.dim": 30, "model.n_heads": 6, "model.n_kv_heads": 2}, "model.n_heads"),
    BadConfig("max_seqlen", {"model.max_seqlen": 16}, "model.max_seqlen", "model.max_seqlen=16; the model must fit "
              "data.seq_len=32; set model.max_seqlen >= 32."),
    BadConfig("attn_impl", {"model.attn_impl": "triton"}, "model.attn_impl"),
    BadConfig("attn_mask", {"model.attn_mask": "bidirectional"}, "model.attn_mask"),
    BadConfig("vocab_size", {"model.vocab_size": 0}, "model.vocab_size"),
    BadConfig("norm_eps", {"model.norm_eps": 0}, "model.norm_eps"),
    BadConfig("nan_lr", {"optim.lr": "nan"}, "optim.lr"),
    BadConfig("scheduler", {"optim.scheduler": "cosinus"}, "optim.scheduler"),
    BadConfig("beta2", {"optim.beta2": 1.0}, "optim.beta2"),
    BadConfig("warmup", {"optim.warmup": -1}, "optim.warmup"),
    BadConfig("lr_min_ratio", {"optim.lr_min_ratio": 2}, "optim.lr_min_ratio"),
    BadConfig("epsilon", {"optim.epsilon": 0}, "optim.epsilon"),
    BadConfig("zero_init_timeout", {"distributed.init_timeout_s": 0}, "distributed.init_timeout_s"),
    BadConfig("backend", {"distributed.backend": "mpi"}, "distributed.backend"),
    BadConfig("fsdp_type", {"distributed.fsdp_type": "hybrid"}, "distributed.fsdp_type"),
    BadConfig("placement", {"distributed.teacher_placement": "middle"}, "distributed.teacher_placement"),
    BadConfig("zero_dp_shard", {"distributed.dp_shard": 0}, "distributed.dp_shard"),
    BadConfig("both_dims_inferred", {"distributed.dp_replicate": -1}, "distributed.dp_replicate"),
    BadConfig("mesh_vs_world_size", {"distributed.dp_shard": 4}, "dp_shard", {
        kind: "Mesh dp_replicate=1 x dp_shard=4 = 4 ranks, but there are 2 training ranks. Set one of them to -1 to "
              f"infer it (e.g. distributed.dp_shard=-1), or launch with 4 student ranks (torchrun --nproc-per-node "
              f"{nproc})."
        for kind, nproc in (("plain", 4), ("distill", 5))}, launch=True),
    BadConfig("alpha", {"distillation.alpha": 1.5}, "distillation.alpha"),
    BadConfig("k", {"distillation.k": 0}, "distillation.k"),
    BadConfig("output", {"distillation.output": "dense"}, "distillation.output"),
    BadConfig("wire_dtype", {"distillation.wire_dtype": "fp8"}, "distillation.wire_dtype"),
    BadConfig("divergence", {"distillation.divergence": "kl"}, "distillation.divergence"),
    BadConfig("sampled_rkl", {"distillation.output": "sampled", "distillation.divergence": "rkl"},
              "distillation.divergence"),
    BadConfig("temperature", {"distillation.temperature": 0}, "distillation.temperature"),
    BadConfig("loss_chunk", {"distillation.loss_chunk_size": -1}, "distillation.loss_chunk_size",
              "distillation.loss_chunk_size=-1; use 0 (auto) or a positive number of positions per chunk."),
    BadConfig("z_loss", {"distillation.z_loss": -1e-4}, "distillation.z_loss",
              "distillation.z_loss=-0.0001; use a finite weight >= 0 (0 = off; 1e-4 is PaLM's value)."),
    BadConfig("jsd_beta_zero", {"distillation.jsd_beta": 0, "distillation.divergence": "jsd"}, "distillation.jsd_beta"),
    BadConfig("distill_prefetch", {"distillation.prefetch": 3}, "distillation.prefetch",
              "distillation.prefetch=3; use auto, 0 (no look-ahead), 1 or 2."),
    BadConfig("distill_prefetch_negative", {"distillation.prefetch": -1}, "distillation.prefetch"),
    BadConfig("distill_prefetch_word", {"distillation.prefetch": "always"}, "distillation.prefetch",
              "distillation.prefetch='always'; use auto, 0 (no look-ahead), 1 or 2."),
    BadConfig("distill_prefetch_float", {"distillation.prefetch": 1.5}, "distillation.prefetch",
              "Invalid value for distillation.prefetch: Value '1.5' of type 'float' is incompatible with type hint "
              "'Union[int, str]'; set distillation.prefetch to an integer or a string."),
    BadConfig("distill_source", {"distillation.source": "offline"}, "distillation.source",
              "distillation.source='offline'; use one of online, cache."),
    BadConfig("cache_without_dir", {"enable_distillation": "true", "distillation.source": "cache"},
              "distillation.cache_dir", "distillation.cache_dir=null; distillation.source=cache needs the folder of "
              "a cache written by apps.main.teacher_cache."),
    BadConfig("fused_loss_not_bool", {"distillation.fused_loss": "maybe"}, "distillation.fused_loss"),
    BadConfig("reduce_every_not_bool", {"distributed.reduce_every_micro_batch": "sometimes"},
              "distributed.reduce_every_micro_batch"),
    BadConfig("teacher_tp", {"distillation.teacher_tp": 0}, "distillation.teacher_tp",
              "distillation.teacher_tp=0; use 1 (one rank per teacher) or the number of ranks to shard each teacher "
              "over."),
    BadConfig("teacher_tp_vs_teacher_ranks", {"enable_distillation": "true", "distillation.teacher_tp": 2},
              "distillation.n_teacher_ranks", "distillation.n_teacher_ranks=1; each teacher replica is "
              "distillation.teacher_tp=2 ranks; use a multiple of it."),
    # The tiny teacher has 4 attention heads and 2 KV heads (its config.json): 4 ranks cannot each hold whole KV heads.
    BadConfig("teacher_tp_vs_heads", {"enable_distillation": "true", "distillation.teacher_path": "{teacher}",
                                      "distillation.teacher_tp": 4, "distillation.n_teacher_ranks": 4},
              "distillation.teacher_tp"),
    BadConfig("no_teacher_path", {"enable_distillation": "true", "distillation.teacher_path": "null"},
              "distillation.teacher_path"),
    BadConfig("missing_teacher_dir", {"enable_distillation": "true", "distillation.teacher_path": "/no/such/teacher"},
              "distillation.teacher_path", "distillation.teacher_path='/no/such/teacher'; that directory does not "
              "exist, nor does its folder /no/such; point it at a transformers checkpoint directory.",
              launch=True),
    BadConfig("seq_len_beyond_teacher", {"enable_distillation": "true", "distillation.teacher_path": "{teacher}",
                                         "data.seq_len": 5000, "model.max_seqlen": 5000},
              "data.seq_len", launch=True),
    BadConfig("log_freq", {"logging.freq": 0}, "logging.freq"),
    BadConfig("wandb_mode", {"logging.wandb.mode": "sometimes"}, "logging.wandb.mode"),
    BadConfig("dump_every", {"checkpoint.dump.every": -1}, "checkpoint.dump.every"),
    BadConfig("keep", {"checkpoint.eval.keep": -2}, "checkpoint.eval.keep"),
    # Meta Lingua's keys: student tensor parallelism, other than 2 views, a SAC switch that contradicts ours.
    BadConfig("tp_size", {"distributed.tp_size": 2}, "distributed.tp_size",
              "distributed.tp_size=2; student tensor parallelism is not available here; set distributed.tp_size=1 "
              "and shard the student with FSDP over distributed.dp_shard (and distributed.dp_replicate).", launch=True),
    BadConfig("n_views", {"data.n_views": 3}, "data.n_views"),
    BadConfig("sac_vs_full", {"distributed.selective_activation_checkpointing": "true",
                              "distributed.activation_checkpointing": "full"}, "distributed.activation_checkpointing"),
    BadConfig("eval_generator_dtype", {"eval.generator.dtype": "int4"}, "eval.generator.dtype"),
    BadConfig("eval_harness_task", {"eval.harness.tasks": "[[1, 2]]"}, "eval.harness.tasks[0]"),
    BadConfig("async_eval_gpus", {"async_eval_gpus": -1}, "async_eval_gpus"),
    BadConfig("eval_every", {"heldout.every": -5}, "heldout.every"),
    BadConfig("eval_batches", {"heldout.max_batches": 0}, "heldout.max_batches"),
    BadConfig("eval_uneven", {"heldout.uneven": "maybe"}, "heldout.uneven"),
    BadConfig("eval_source_without_val", {"heldout.every": 1, "data.eval_sources": "[nope]"}, "data.eval_sources"),
    BadConfig("profile_steps", {"profiling.profile_steps": 0}, "profiling.profile_steps"),
    BadConfig("mem_warmup", {"profiling.mem_warmup": -1}, "profiling.mem_warmup"),
    BadConfig("no_root_dir", {"data.root_dir": "null"}, "data.root_dir"),
    BadConfig("missing_root_dir", {"data.root_dir": "/nonexistent/corpus"}, "data.root_dir"),
    BadConfig("zero_weights", {"data.sources.text": 0}, "data.sources"),
    BadConfig("negative_weight", {"data.sources.text": -1}, "data.sources.text"),
    BadConfig("zero_seq_len", {"data.seq_len": 0}, "data.seq_len"),
    BadConfig("prefetch", {"data.prefetch_size": 0}, "data.prefetch_size"),
    BadConfig("data_workers", {"data.workers": -1}, "data.workers"),
    BadConfig("tokenizer_name", {"data.tokenizer.name": "gpt2"}, "data.tokenizer.name"),
    BadConfig("tokenizer_without_path", {"data.tokenizer.name": "sp", "data.tokenizer.path": "null"},
              "data.tokenizer.path"),
    BadConfig("missing_tokenizer", {"data.tokenizer.name": "hf", "data.tokenizer.path": "/nonexistent/tok"},
              "data.tokenizer.path"),
]
