"""The main commands: train a student (with or without its teachers), evaluate it, write a teacher cache.

    train.py            the loop, read top to bottom: train() for students, the teacher ranks' serving
    eval.py             in-loop held-out eval (EvalArgs); lm-eval + perplexity of a checkpoint
    checkpoint_eval.py  Meta Lingua's eval: section, on each checkpoint.eval save, in-process or via stool
    eval_tasks/         our lm-eval tasks (pydocs_cloze)
    report.py           what a step logs: metrics rows, progress line, warnings, summary
    teacher_wait.py     the students' wait on a teacher: its bottleneck (or not) and the remedy, for the warning
    transformer.py      the student LM (Llama-style)
    export_hf.py        student -> transformers LlamaForCausalLM
    generate.py         sample text from a checkpoint
    teacher_cache.py    the cache writer's command line (its library is lingua/distillation/cache/)
    convert_cache.py    a version 1 teacher cache to version 2; --sizes: bytes per token per stream
"""
