"""Cross-tokenizer distillation: a teacher whose tokenizer is not the student's (DESIGN.md §15). Entered by a teacher
rank and the cache writer (`teacher_side.load_cross_tokenizer`); below the roads, beside the loss.

    token_bytes.py   student_token_bytes (any lingua tokenizer) and hf_token_bytes: every id's bytes, None for specials
    vocab_map.py     VocabMap, build_vocab_map: teacher id -> student id by equal bytes, -1 unmapped
    alignment.py     WindowAligner: a student window -> the teacher's tokens and, per student position, the teacher
                     position that predicts the same next text (or -1)
    targets.py       the teacher's top-k at those positions as student top-k + kd_weight (unmapped mass in the rest);
                     sample_student_ids / student_sampled_targets: the sampled format's draws in student ids
    teacher_side.py  CrossTokenizerTeacher: student windows -> the teacher's [N, L] grid, and its outputs back
"""
