"""The teacher model: a Hugging Face checkpoint checked, loaded (whole or tensor-parallel) and run.
Entered by the online server and the cache writer; the launch's checks run before any process group.

    model.py           TeacherModel: a transformers checkpoint checked, loaded and run (document boundaries too)
    tensor_parallel.py distillation.teacher_tp > 1: the teacher sharded over its replica's group (torch's
                       parallelize_module, the model's own plan), each rank's shards read from the safetensors
                       files, its vocabulary slice, the head-count check
    vocab_parallel.py  the outputs from each rank's vocabulary slice (merged top-k, sampling, full, CE)
    roster.py          the launch's teachers, one or several: their checks before any process group, which one a
                       teacher rank serves as
"""
