"""The distillation subsystem: where a student's KD targets come from and how they become its loss.

A run has one or several teachers (`distillation.teachers`; teacher_path is read into a list of one); each is online
(ranks of its own) or read from its cache, in any mixture. The training loop asks one `Distiller` for the KD part of
each step and knows nothing else about teachers.

Shared roots (every road enters through these):

    args.py            DistillationArgs (the `distillation:` config section), TeacherArgs, alpha_at
    outputs.py         TeacherOutputs: the wire and cache formats (topk, sampled, full), sparsify_teacher_logits
    distiller.py       the seam (the loop's six calls): Distiller, NoDistiller (CE only), KDDistiller (the KD loss of
                       1..N teachers, their metrics); the tokenizer's identity (tokenizer_vocab, tokenizer_fingerprint)
    micro_batches.py   MicroBatchFeed: a step's micro-batches, their teacher requests submitted ahead (look-ahead)
    build.py           what the trainer asks: launch_teachers (a launch's TeacherLayouts), build_distiller (a student's
                       Distiller and its teachers' caches), serve_teacher (a teacher rank), the agreed look-ahead

Rooms, one per road (each `__init__` maps its own files; imports go down, never across roads):

    loss/              the KD loss fused with the output head, its float64 reference, divergences, ULD, the mixture
                       of several teachers' terms
    online/            the online road: OnlineDistiller, the bridge's wire records, the student's client, the
                       teacher's server, its serving clock, a tensor-parallel replica's rounds
    teacher/           the teacher model: loading and checks, tensor and vocabulary parallel, the launch's teachers
    cache/             the offline teacher cache: CacheDistiller, manifest and shards, the codec, the writer's job and
                       pipeline, the readers
    cross_tokenizer/   a teacher whose tokenizer is not the student's: token bytes, vocabulary map, alignment, targets

Rooms import the shared roots and the rooms below them (loss, teacher, cross_tokenizer); online and cache are
roads and never import each other (tests/unit/test_layout.py).

How a micro-batch flows (online): `MicroBatchFeed.submit_ahead` -> `OnlineDistiller.submit` -> `TeacherClient.submit`
(a gather of [header, tokens], a scatter of the response, on the bridge group); `TeacherServer.serve` runs one forward
for every student's rows and scatters each its own. The model calls `Distiller.head_loss(hidden, head_weight)`, which
waits for the handles and computes `teachers_head_loss`. With a cache, the targets arrive inside each batch; the
cache's writer is `cache/write_job.py`, whose command line is `apps.main.teacher_cache`.
"""
