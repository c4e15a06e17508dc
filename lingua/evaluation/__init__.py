"""In-loop evaluation's data and units (the downstream tasks are `apps/main/eval.py`).

    heldout.py         held-out batches: the sources' `*.val.jsonl` files sharded, tokenized, packed and padded
    bits_per_byte.py   held-out loss in bits per byte: CE that compares across tokenizers
"""
