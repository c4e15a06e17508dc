"""Benchmarks: commands that measure speed, bytes and memory on the machine they run on, and write results.json
(docs/benchmarks.md has the commands and dated figures). Studies, which answer a question, are `apps/studies/`.

    distill.py           online distillation: the same students with KD off and on, in one invocation
    distill_report.py    its report: the numbers as a markdown table with the settings and notes
    launcher.py          launching a trainer under torchrun for a benchmark, sampling its ranks from /proc
    latency_teacher.py   the trainer with a teacher that takes a fixed time per request (a teacher on its own GPU)
    prefetch_latency.py  how much of the teacher's time the students' look-ahead hides: prefetch 0 vs 1
    loss_step.py         the output head + loss step: CE alone, CE + kd_loss, the fused CE + KD loss
    loss_against.py      `loss_step --against liger`: ours beside Liger-Kernel's fused linear CE and JSD
    loss_inputs.py       the loss benches' settings, seeded inputs and process-memory readings
    uld_loss.py          the fused loss with ULD on against off, on the same cross-tokenizer targets
    codec_speed.py       teacher cache format v2: bytes per token on disk, encode/decode speed
    feeding.py           feeding rates: what the host delivers to one rank, in tokens/s
    feeding_step.py      `feeding --device cuda`'s whole step: CE-only against KD from a teacher cache
    alignment_cost.py    cross-tokenizer alignment on real tokenizers: aligned share and the teacher's cost
    tp_load.py           loading a tensor-parallel teacher: own shards from safetensors against load-and-slice
    host_overhead.py     the host's work per step of a tiny student: our trainer against minimal loops (FSDP2 or not)
    scale_build.py       building a wide student (0.8B, llama_1B; 8B on meta): per-rank peak memory against 4N/S
"""
