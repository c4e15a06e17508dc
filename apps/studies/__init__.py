"""Studies: long experiments that answer a question and write a dated results page (not benchmarks).

    kd/     the KD-vs-CE study and the data wall: what a teacher is worth to a small student (`python -m apps.studies.kd`)
    xtok/   the cross-tokenizer study: does SmolLM2 teach a student that keeps its own tokenizer?
"""
