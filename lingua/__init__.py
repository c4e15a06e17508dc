"""Meta Lingua-style pretraining with online knowledge distillation.

Lingua's own modules, where a Lingua user looks:

    args.py          TrainArgs' parsing: `config=file.yaml a.b=c` into dataclasses, unknown keys refused
    checkpoint.py    CheckpointArgs, CheckpointManager: DCP saves and loads, atomic, resumable
    data.py          DataArgs, the DataLoader: a rank's windows from the sources (see loading/)
    distributed.py   DistributedArgs, setup_torch_distributed, Topology: the groups every component is handed
    logger.py        one line per event, with rank and role
    metrics.py       LoggingArgs, MetricLogger: metrics.jsonl and wandb
    optim.py         OptimArgs, build_optimizer: AdamW and the lr schedule
    probe.py         ActivationProbe: activation statistics every probe_freq steps
    profiling.py     ProfilerArgs, maybe_run_profiler: torch.profiler traces and memory snapshots
    stool.py         StoolArgs: submit a run to SLURM (`python -m lingua.stool`)
    tokenizer.py     bytes, tiktoken, sentencepiece and Hugging Face tokenizers behind one interface
    transformer.py   BaseTransformer, the attention and the fused cross-entropy

What this project adds around them:

    errors.py        the errors a user can fix, apart from bugs
    slurm.py         what stool hands to SLURM: the sbatch script and the submitit executor
    timing.py        startup phase spans and per-step timers
    cli/             entry points, `key=value` overrides, `--help`
    loading/         documents on disk, the stream, the producer process, worker pools
    evaluation/      held-out batches and bits per byte
    run/             the dump directory: its files, its owner, its checkpoints' health
    parallel/        the launch plan, collectives, timeouts, FSDP, preemption, rank status
    distillation/    teachers online or from caches, and the KD loss
"""
