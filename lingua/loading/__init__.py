"""Training data from disk to batches, around `lingua/data.py` (DataArgs, the DataLoader users see).

    documents.py     documents on disk: the jsonl chunk layout, sharding files over ranks, the line rule and skips
    stream.py        a rank's training stream without torch: read, tokenized, packed, mixed, resumable state
    producer.py      batches built in a producer process per rank (Meta Lingua's async_iterator), a bounded pipe
    process_pool.py  worker process pools that fail loudly and stop at once (producer tokenizers, cache encoders)
"""
