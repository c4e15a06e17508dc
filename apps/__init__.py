"""Entry points: each `python -m apps.<...>` command a user runs (the library they use is `lingua/`).

    main/      training, evaluation, the teacher cache writer, export and generation
    debug/     diagnostics: startup phases, the GPU self-check and its benches, post-mortems, trace summaries
    plan/      the placement planner: how to split a cluster between a teacher and its students
    bench/     benchmarks: commands that measure speed, bytes and memory and write results
    studies/   studies that answer a question and write a dated results page
    plots.py   PNG of a run's curves, or several runs side by side
"""
