"""A run's dump directory: where each output lives, who owns it, and what its checkpoints' files say; a rank's life.

    dump_dir.py            RunDir: each output's path; tolerant readers of the jsonl files (metrics, rank status)
    owner.py               one live run per dump dir: `<dump_dir>/owner.json`, taken before any process group
    launch.py              launched_rank: a rank's life in a launch (the dump dir taken, process groups, log, status
                           file and watch, the crash agreed, the last barrier, teardown), around train or serve
    checkpoint_health.py   a checkpoint's files read when a save or load goes wrong: one sentence, not a traceback
    resume_fit.py          whether a launch's config fits the run in its dump dir: another model is refused, another
                           steps= is said (from the newest checkpoint's params.json)
"""
