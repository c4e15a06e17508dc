"""The distillation subsystem: where a student's KD targets come from and how they become its loss.

A run has one or several teachers; each is online (ranks of its own) or read from its cache. The training loop
asks one `Distiller` for the KD part of each step and knows nothing else about teachers.

Shared roots (every road enters through these):

    args.py            DistillationArgs (the `distillation:` config section), TeacherArgs, alpha_at
    outputs.py         TeacherOutputs: the wire and cache formats (topk, sampled, full), sparsify_teacher_logits
    distiller.py       the seam: Distiller, NoDistiller (CE only), OnlineDistiller, CacheDistiller
    mixed_distillers.py  several teachers: SeveralTeachersDistiller (one bridge each), CachedTeachersDistiller
    mixture.py         several teachers: routing by data source, each position's KD weights, the mixed loss
    micro_batches.py   MicroBatchFeed: a step's micro-batches, their teacher requests submitted ahead (look-ahead)
    build.py           build_distiller: which Distiller a student gets; the look-ahead the students agree on

Rooms, one per road (each `__init__` maps its own files; imports go down, never across roads):

    loss/              the KD loss fused with the output head, its float64 reference, divergences, ULD
    online/            the online road: the bridge's wire records, the student's client, the teacher's server,
                       its serving clock, a tensor-parallel replica's rounds
    teacher/           the teacher model: loading and checks, tensor and vocabulary parallel, the launch's teachers
    cache/             the offline teacher cache: manifest and shards, the codec, the writer's pipeline, the readers
    cross_tokenizer/   a teacher whose tokenizer is not the student's: token bytes, vocabulary map, alignment, targets

How a micro-batch flows (online): `MicroBatchFeed.submit_ahead` -> `OnlineDistiller.submit` ->
`TeacherClient.submit` posts a gather of [header, tokens] and a scatter of the response on the bridge group; the
teacher's `TeacherServer.serve` receives every student's rows, runs one forward (`TeacherModel`), and scatters
each student its own rows. In the student's forward the model calls `Distiller.head_loss(hidden, head_weight)`,
which waits for the handle and computes `fused_linear_kd_loss`. With a cache, the same targets arrive inside
each batch and nothing waits. The cache's writer is `apps.main.teacher_cache`.
"""
