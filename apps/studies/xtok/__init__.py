"""The cross-tokenizer study (`python -m apps.studies.xtok.study`); it reuses the KD study's arms and launcher.

    study.py    the runs: a byte-tokenizer student with and without SmolLM2 across tokenizers, one command
    report.py   results.json and table.md from the finished runs
"""
