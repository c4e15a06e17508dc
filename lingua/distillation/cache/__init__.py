"""The offline teacher cache: a teacher's outputs written once (`apps.main.teacher_cache`) and read as data.
Entered by the cache distillers (reading) and the writer's command line (writing).

    store.py           the format: manifest, safetensors shards, atomic writes, CacheLoader (what training reads)
    codec.py           format v2: a shard's tensors coded losslessly (sorted values as bit-pattern gaps, ids by
                       frequency rank, sampled draws as distinct ids with counts), then zstd
    writer.py          the writer's pipeline: windows read ahead, shards encoded and written by worker processes
                       while the teacher runs
    several.py         several teachers' caches read in step: their layouts and windows checked against each other
"""
