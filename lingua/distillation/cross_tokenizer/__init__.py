"""Cross-tokenizer distillation: a teacher whose tokenizer is not the student's (DESIGN.md §15).

The student's tokenizer stays the user's. Both tokenizers are read down to the bytes each id stands for; a
vocabulary map is built once from them; each student window is aligned to the teacher's tokens by byte offsets of
its text; the teacher's top-k at aligned positions become student targets in the usual top-k format, with a
per-position KD weight (1 aligned, 0 unaligned: CE only); or, for output=sampled, draws in student ids.

    token_bytes.py   student_token_bytes (bytes, tiktoken, sp, hf) and hf_token_bytes: every id's bytes, None for
                     specials (byte-level "Ġ" and SentencePiece "▁" / "<0xNN>" spaces and bytes handled)
    vocab_map.py     VocabMap, build_vocab_map: teacher id -> student id by equal bytes, -1 unmapped
    alignment.py     WindowAligner: a student window -> the teacher's tokens, document ids and, per student
                     position, the teacher position that predicts the same next text (or -1)
    targets.py       student_topk_targets: the teacher's top-k at those positions as student top-k + kd_weight
                     (masses of ids mapping to one student id added, unmapped mass into the "rest" bucket);
                     sample_student_ids / student_sampled_targets: the sampled format's draws in student ids
                     (-1: an unmapped draw, no student term)
    teacher_side.py  CrossTokenizerTeacher: a batch of student windows -> the teacher's padded/cut [N, L] grid,
                     and its top-k back in the student's positions (what a teacher rank or a cache writer runs)
"""
