"""The KD-vs-CE study: what is the teacher worth to a small student, in CE tokens, in FLOPs, downstream?

    python -m apps.studies.kd --out dumps/kd_study          # caches, 5-6 arms x 3 seeds, cloze evals, report
    python -m apps.studies.kd --seeds 0 --steps 8 --out /tmp/kd_quick heldout.max_batches=4   # the pipeline, minutes
    python -m apps.studies.kd --out dumps/kd_study --report-only   # re-render from the runs on disk
    python -m apps.studies.kd --wall --unique-tokens 16384 --out dumps/kd_wall   # the data wall (wall.py)
    python -m apps.studies.kd --wall --device cuda --out dumps/kd_wall_gpu     # where users stand, one GPU

Setup (configs/distill_exps/kd_study.yaml): SmolLM2-135M-Instruct teaches a 7M student that uses its
tokenizer, on the embedded Python-docs corpus. The teacher's outputs are written once per output format by
`apps.main.teacher_cache` (`<cache-root>/cache_topk64`, `cache_sampled64`; skipped when complete), laid
out for one student (`streams=1`), so a run from a cache reads exactly the windows a plain one-rank
DataLoader yields, in the same order. The arms:

    ce            CE only (enable_distillation=false) on the raw corpus, the KD arms' tokens (1x)
    ce_2x         the same with 2x the steps (its own full lr schedule); its windows after the 1x budget
                  follow on from the cached ones (the loader loops over the training split, epoch by epoch)
    ce_4x         4x: with `--ce-multiples auto` only when some KD arm's final held-out CE is below its
                  seed's ce_2x final (else the 2x curve already brackets every KD result)
    kd_topk64     alpha = 0.5, T = 1, forward KL against the cached top-64 outputs (+ the tail bucket)
    kd_topk64_lr  the same with alpha following the lr schedule (KD early, CE as the lr decays)
    kd_sampled64  alpha = 0.5 against 64 ids sampled from the teacher per position (an unbiased
                  Monte-Carlo forward KL), from its own cache (388 bytes per token on the bridge, as top-64; about half
                  of top-64's on disk in the cache's format v2: its draws are distinct ids with counts)

A seed is the student's init (`model.seed`): seed s of every arm starts from the same weights and reads
the same windows, so arms compare paired. Each run evaluates the whole held-out split every `heldout.every`
steps; after it ends its final checkpoint is scored on `pydocs_cloze` (`apps.main.eval`).

Reported (results.json, table.md, kd_study.png): per arm and seed the held-out curve and final CE,
`token_multiplier` of each KD arm (the CE tokens at which CE-only reaches the KD arm's final held-out
CE, interpolated between the CE budgets' finals in log-tokens, per seed), `cloze_acc`, and `flops`
(student, teacher online, teacher cache amortized over the runs that read it). Finished runs and evals
are kept: rerunning resumes a study; an unfinished run restarts from scratch.

The package, in the order a study runs:

    arms.py     the arms (ARMS, CACHES), one run (Run), the inputs' checks
    disk.py     what a study directory holds: finished runs, cloze results, wall times, complete caches
    launch.py   the teacher caches, the runs and their cloze evals, `parallel` at a time, stopped cleanly
    results.py  results.json's numbers: curves, pairing by seed, the token multiplier, FLOPs
    render.py   kd_study.png and table.md
    study.py    main: plan the runs, caches, phase one, the 4x decision, report; --wall hands over to wall.py
    wall.py     the data-wall mode: U unique tokens read for E epochs, CE (two weight decays) and KD arms
    wall_inprocess.py  --wall --device: every run in one process (U = 2M tokens on one GPU; --tiny on a CPU),
                the held-out CE on both splits (pydocs and the post-cutoff repodocs) with the teacher's beside it
    wall_report.py  its report: held-out CE vs E and vs FLOPs, the CE frontier, the crossings, the wall
    __main__.py `python -m apps.studies.kd` runs study.main
"""
