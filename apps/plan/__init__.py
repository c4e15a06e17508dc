"""Placement planner: how to split a cluster between a teacher and its students, before renting it.

    python -m apps.plan config=configs/llama_1B.yaml world_size=64 gpus_per_node=8 gpu_mem_gib=80 \\
        teacher_config=configs/teachers/llama3_8b.json [teacher_tokens_per_s=... student_tokens_per_s=...]

Prints a plan, and writes it as JSON where asked (`out=plan.json`; by default it prints only). Its first line is the answer
(distill or not, online or from a cache, the layout, the break-even, the GPU-hours, and the pilot first with its
GPU-hours where the plan is not measured); the lines below are its evidence. Any training key overrides the config
as in training (`data.batch_size=8 distillation.k=32`), and the config is read with the trainer's defaults
(`lingua.args.fill_training_defaults`: Meta Lingua's configs as they are). Every command it prints runs as printed
(tokenizers.py: the teacher's path from the inputs or a placeholder validation names, the students' tokenizer).
What it decides, in order:

1. Sizes. The teacher's from its config.json (`teacher_config=`, else `<distillation.teacher_path>/config.json`),
   counted as a Llama-family model (embeddings, q/k/v/o, gate/up/down, two norms a layer, a final norm, a head
   unless tied; biases where `attention_bias` / `mlp_bias` say so); the student's from the config's `model`
   section without building it (`num_parameters`), at the vocabulary the trainer gives it when
   `model.vocab_size=-1`: its tokenizer's, the teacher's unless `distillation.cross_tokenizer=true` keeps the
   config's own tokenizer.
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
   from which the cache is the cheaper road, and the cache writer's command (`apps.main.teacher_cache` with
   replicas of the smallest teacher_tp that fits, a stream per GPU training from the cache, the planned windows
   split evenly between them: it writes exactly the planned tokens).
6. Whether to distill at all (`unique_tokens=`, `kd_measurement=`, `show=verdict`): see verdict.py. Where the
   plan is not measured, it prints a pilot: two short training runs, then `python -m apps.plan.pilot`, whose
   results.json (`kd_measurement=`) measures the plan.

The package, in the order a plan is made:

    args.py      PlanArgs (a training config plus the cluster and its measured speeds), the constants
    sizes.py     TeacherShape from a config.json, the student's training FLOPs per token
    memory.py    TeacherMemory: one teacher rank's bytes at teacher_tp = t for one request
    timing.py    Speeds, Layout (replicas x teacher_tp), Timing (the students' wait with look-ahead)
    planner.py   Planner: the smallest fitting teacher_tp, the layout that keeps up, the cache road
    verdict.py   should it distill at all: the teacher's overhead, the break-even token multiplier (fresh, and
                 behind a data wall by the effective-data law), the multiplier a named study measured
    evidence.py  what that study measured, the plan's settings outside it ("not measured here"), the pilot
    printing.py  format_plan (the printed lines), write_plan (only over a plan of its own)
    teachers.py  several teachers (distillation.teachers): each at its configured ranks, the slowest named
    tokenizers.py  the keys the printed commands need (teacher path, students' tokenizer); the cross-tokenizer ratio
                 measured where both tokenizers are here
    cli.py       main: parse, validate, plan, print, write (`python -m apps.plan` runs it via __main__.py)
    pilot.py     `python -m apps.plan.pilot`: the two pilot runs' held-out CE -> kd_study's token multiplier,
                 a results.json for kd_measurement=
"""
