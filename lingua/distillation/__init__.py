"""The distillation subsystem: where a student's KD targets come from and how they become its loss.

Student side (the loop asks one `Distiller` for the KD part of each step):

    distiller.py       Distiller: NoDistiller (CE only), OnlineDistiller (a teacher rank), CacheDistiller (a cache)
    mixed_distillers.py  several teachers (distillation.teachers): SeveralTeachersDistiller (one bridge per
                       teacher), CachedTeachersDistiller (one cache per teacher)
    build.py           build_distiller: which Distiller a student gets; the look-ahead the students agree on
    mixture.py         several teachers: routing by data source, each position's KD weights, the mixed loss
    teachers.py        the launch's teachers, one or several: their checks before any process group, which one a
                       teacher rank serves as
    feed.py            MicroBatchFeed: a step's micro-batches, their teacher requests submitted ahead (look-ahead)
    client.py          TeacherClient: the student end of a bridge (handshake, submit -> handle.wait(), STOP)
    fused_loss.py      fused_linear_kd_loss: CE + KD fused with the output head (the default loss)
    fused_chunk.py     one chunk of it: KD folded into CE's passes over [rows, V]; grad_W by vocabulary blocks
    compiled_chunk.py  that chunk math under torch.compile (distillation.loss_compile): Triton on CUDA, C++ on CPU
    reference_loss.py  kd_loss on logits: the float64 check of the fused loss (distillation.fused_loss=false)
    divergences.py     the math both losses share: fkl/rkl/jsd and their gradients, teacher buckets, CE/KD mix
    uld.py             ULD (distillation.uld_weight): sorted-probability distance for a cross-tokenizer teacher's
                       unmapped mass; the wire's marked entries, the reference and the fused chunk's closed form
    cache.py           the offline teacher cache: manifest, safetensors shards, the loader training reads
    teacher_caches.py  several teachers' caches read in step: their layouts and windows checked against each other
    cache_codec.py     cache format v2: a shard's tensors coded losslessly (sorted values as bit-pattern gaps,
                       ids by frequency rank, sampled draws as distinct ids with counts), then zstd
    cache_writer.py    the cache writer's pipeline: windows read ahead, shards encoded and written by worker
                       processes while the teacher runs

Teacher side (the last ranks run `apps.main.train.distillation_process`):

    server.py          TeacherServer: load, handshake, then receive -> handle -> reply until STOP
    serving_clock.py   ServingClock (busy/idle seconds), TimeoutSwitch (the teacher's timeout, generous while the
                       students start up or announce a pause, short otherwise)
    teacher.py         TeacherModel: a transformers checkpoint checked, loaded and run (document boundaries too)
    outputs.py         TeacherOutputs: the wire formats (topk, sampled, full) and sparsify_teacher_logits
    tensor_parallel.py distillation.teacher_tp > 1: the teacher sharded over its replica's group (torch's
                       parallelize_module, the model's own plan), each rank's shards read from the safetensors
                       files, its vocabulary slice, the head-count check
    vocab_parallel.py  the outputs from each rank's vocabulary slice (merged top-k, sampling, full, CE)
    replica.py         a replica's ranks as one teacher: load records, the bridge spec, one round per request

Cross-tokenizer (a teacher whose tokenizer is not the student's; issue 36, phase 1: the library, not wired yet):

    cross_tokenizer/   token bytes of every tokenizer kind, the vocabulary map, alignment of student windows to
                       the teacher's tokens by byte offsets, and the teacher's top-k as student targets + kd_weight

Both ends:

    bridge.py          the wire records (RequestHeader, HandshakeRecord, ResponseStatus) and the handshake
    args.py            DistillationArgs (the `distillation:` config section), alpha_at

How a micro-batch flows (online): `feed.submit_ahead` -> `OnlineDistiller.submit` -> `TeacherClient.submit`
posts a gather of [header, tokens] and a scatter of the response on the bridge group; the teacher's
`TeacherServer.serve` receives every student's rows, runs one forward (`TeacherModel.hidden_states` then
`sparse_outputs`), and scatters each student its own rows. A tensor-parallel replica's first rank does that,
sharing each request with the replica's other ranks, which run their shards of the same forward. In the student's forward the model calls
`Distiller.head_loss(hidden, head_weight)`, which waits for the handle and computes `fused_linear_kd_loss`.
With the cache, the same targets arrive inside each batch and nothing waits. The offline writer of the cache
is an app: `apps/main/teacher_cache.py`; `apps/main/convert_cache.py` converts a version 1 cache.
"""
