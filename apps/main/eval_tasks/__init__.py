"""Our lm-eval tasks: apps.main.eval hands this folder to lm-eval's TaskManager (`include_path`).

    pydocs_cloze.py      the task's items and scoring: a held-out Python-docs sentence, its missing word among 4
    pydocs_cloze.yaml    the task's lm-eval definition
    pydocs_cloze.jsonl   its items, built by setup.prepare_corpus from the held-out split
"""
