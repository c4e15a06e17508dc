"""The offline teacher cache: a teacher's outputs written once (`apps.main.teacher_cache`) and read as data.
Entered by the builder (reading: its distiller and reader) and the writer's command line (writing).

    distiller.py       CacheDistiller: every teacher's targets come with each batch, nothing to wait for
    reader.py          the reader, TeacherCaches: 1..N teachers' caches (one teacher is a list of one) read in step as
                       the training dataset, checked against the students' settings and each other
    store.py           the format: manifest, safetensors shards, atomic writes, reading a shard's rows
    codec.py           format v2: a shard's tensors coded losslessly (sorted values as bit-pattern gaps, ids by
                       frequency rank, sampled draws as distinct ids with counts), then zstd
    writer.py          the writer's pipeline: windows read ahead, shards encoded and written by worker processes
                       while the teacher runs
    write_job.py       the writer's job: the planned manifest, each rank's shards (StreamReader, write_shards),
                       resuming (settle_manifest), the held-out line
"""
