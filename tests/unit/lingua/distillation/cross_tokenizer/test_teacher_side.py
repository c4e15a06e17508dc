"""The teacher's side of a cross-tokenizer batch with a real (tiny, random) transformers teacher: the student's
rows become one padded grid of the teacher's tokens, and neither the padding nor the cut at the teacher's max
positions changes any aligned target."""

import pytest
import torch

from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher
from lingua.distillation.outputs import sparsify_teacher_logits
from lingua.tokenizer import ByteTokenizer

TEXTS = ["def f(x): return x + 1", "Commas, periods; colons: and \"quotes\".", "ünï 🎉 short"]


@pytest.fixture(scope="module")
def teacher(tiny_teacher):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_teacher), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_teacher))


def student_rows(student, texts, seq_len):
    """Windows as the loader packs them: each text [bos] ... [eos], cut or repeated to seq_len tokens."""
    rows = []
    for text in texts:
        tokens = student.encode(text, add_bos=True, add_eos=True) * 4
        rows.append(tokens[:seq_len])
    return torch.tensor(rows)


def targets(cross, model, input_ids, k=8):
    batch = cross.teacher_batch(input_ids)
    with torch.no_grad():
        logits = model(batch.tokens).logits
    return batch, cross.student_outputs(sparsify_teacher_logits(logits, "topk", k, 1.0, torch.float32), batch,
                                        torch.float32)


def test_padding_changes_no_target(teacher):
    model, tokenizer = teacher
    student = ByteTokenizer()
    cross = CrossTokenizerTeacher(student, tokenizer)
    input_ids = student_rows(student, TEXTS, 40)
    batch, (outputs, kd_weight) = targets(cross, model, input_ids)
    assert batch.tokens.shape[0] == 3 and batch.tokens.shape[1] < 40  # BPE: fewer teacher tokens than bytes
    assert 0.0 < batch.aligned_share <= 1.0 and kd_weight.mean().item() == pytest.approx(batch.aligned_share)
    for row in range(3):
        alone, (row_outputs, row_weight) = targets(cross, model, input_ids[row: row + 1])
        assert torch.equal(row_weight[0], kd_weight[row])
        aligned = kd_weight[row].bool()
        torch.testing.assert_close(row_outputs.values[0][aligned], outputs.values[row][aligned], rtol=1e-4, atol=1e-4)
        assert torch.equal(row_outputs.ids[0][aligned], outputs.ids[row][aligned])


def test_the_cut_at_max_positions_unaligns_only_what_lies_past_it(teacher):
    model, tokenizer = teacher
    student = ByteTokenizer()
    input_ids = student_rows(student, TEXTS, 40)
    full_batch, (full, full_weight) = targets(CrossTokenizerTeacher(student, tokenizer), model, input_ids)
    cap = full_batch.tokens.shape[1] // 2
    cut_batch, (cut, cut_weight) = targets(CrossTokenizerTeacher(student, tokenizer, max_positions=cap), model,
                                           input_ids)
    assert cut_batch.tokens.shape[1] == cap
    assert ((cut_weight <= full_weight).all() and cut_weight.sum() < full_weight.sum())
    # Unaligned by the cut: exactly the positions whose target was at column >= cap.
    columns = full_batch.source % full_batch.tokens.shape[1]
    assert torch.equal(cut_weight.bool(), full_weight.bool() & (columns < cap))
    kept = cut_weight.bool()
    torch.testing.assert_close(cut.values[kept], full.values[kept], rtol=1e-4, atol=1e-4)


def test_the_map_is_the_pair_s(teacher):
    """The teacher's byte-level tokens that are one byte map onto the byte tokenizer, its bos and eos onto the
    student's by role; its other specials do not map."""
    _, tokenizer = teacher
    cross = CrossTokenizerTeacher(ByteTokenizer(), tokenizer)
    table = cross.vocab_map.teacher_to_student
    assert cross.vocab_map.mapped == 256 + 2
    assert (int(table[tokenizer.bos_token_id]), int(table[tokenizer.eos_token_id])) == (256, 257)
    assert all(table[i] == -1 for i in set(tokenizer.all_special_ids) - {tokenizer.bos_token_id,
                                                                         tokenizer.eos_token_id})
    assert cross.pad_id == tokenizer.pad_token_id


def test_the_alignment_bench_prints_a_row_per_pair(corpus, capsys):
    """`python -m apps.bench.alignment_cost` in-process on the test corpus (the byte student; Llama 3's is in the
    vocabulary tests): its row, a share in (0, 1]."""
    from apps.bench.alignment_cost import main

    main(["--corpus", str(corpus / "text"), "--seq-len", "64", "--windows", "4", "--rounds", "1", "--students",
          "bytes"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| bytes")]
    assert len(rows) == 1 and rows[0][2] == "237 of 49152"  # 235 bytes, and the bos and eos by role
    assert 0.0 < float(rows[0][3]) <= 1.0 and float(rows[0][5]) > 0
    assert rows[0][6:] == ["-", "- |"]  # no --teacher-path: the forward is not timed


@pytest.mark.parametrize("max_positions", [None, 8])
def test_own_heldout_scores_the_students_windows_text_in_the_teachers_tokens(teacher, corpus, max_positions):
    """The teacher's held-out bits per byte (cross-tokenizer): each student window becomes the same text in the
    teacher's tokens (cut to its max positions), and the bytes are those of the teacher's targets."""
    from lingua.data import DataArgs
    from lingua.evaluation.heldout import iterate_eval_batches
    from lingua.tokenizer import TokenizerArgs

    _, hf = teacher
    student = ByteTokenizer()
    data = DataArgs(root_dir=str(corpus), sources={"text": 1.0}, batch_size=4, seq_len=48, add_bos=True,
                    add_eos=True, tokenizer=TokenizerArgs("bytes"))
    batches = list(iterate_eval_batches(data, student, 0, 1, max_batches=3))
    cross = CrossTokenizerTeacher(student, hf, max_positions)
    own, n_bytes = cross.own_heldout(batches)
    assert [b["input_ids"].shape[0] for b in own] == [4, 4, 4]
    hand_bytes = 0
    for student_batch, teacher_batch in zip(batches, own):
        for row in range(4):
            window = student_batch["input_ids"][row].tolist() + [int(student_batch["labels"][row, -1])]
            labels = teacher_batch["labels"][row]
            n = int((labels != -100).sum())
            assert (labels[:n - 1] == teacher_batch["input_ids"][row, 1:n]).all()  # labels: the next teacher token
            scored = hf.decode(labels[:n].tolist(), skip_special_tokens=True)
            hand_bytes += len(scored.encode("utf-8"))
            whole = hf.decode([int(teacher_batch["input_ids"][row, 0])] + labels[:n].tolist(),
                              skip_special_tokens=True)
            text = bytes(t for t in window if t < 256).decode("utf-8")
            if max_positions is None:  # the same text as the student's window, in the teacher's tokens
                assert whole == text
            else:
                assert n <= max_positions and text.startswith(whole)
    assert n_bytes == hand_bytes > 0


def test_the_label_past_each_row_aligns_its_last_position(teacher):
    """Given each row's label past the window, the teacher's grid and targets are the longer window's, cut to the
    student's positions (its document ids numbered on): at every cut, and some cuts' last positions get targets
    they had not without it (the label starts a teacher token, or is the document's eos)."""
    from lingua.distillation.cross_tokenizer.alignment import student_doc_ids

    _, tokenizer = teacher
    student = ByteTokenizer()
    cross = CrossTokenizerTeacher(student, tokenizer)
    rows = student_rows(student, TEXTS, 48)
    all_docs = torch.tensor([student_doc_ids(row, student.bos_id, student.eos_id) for row in rows.tolist()])
    gained = 0
    for seq_len in range(8, 47):
        longer, docs = rows[:, :seq_len + 1], all_docs[:, :seq_len + 1]
        whole = cross.teacher_batch(longer, docs)
        with_label = cross.teacher_batch(longer[:, :-1], docs[:, :-1], longer[:, -1])
        without = cross.teacher_batch(longer[:, :-1], docs[:, :-1])
        assert torch.equal(with_label.tokens, whole.tokens) and torch.equal(with_label.doc_ids, whole.doc_ids)
        assert torch.equal(with_label.source, whole.source[:, :-1])
        assert (without.source[:, -1] == -1).all()
        gained += int((with_label.source[:, -1] >= 0).sum())
        assert torch.equal(cross.teacher_batch(longer[:, :-1], docs[:, :-1], torch.full((3,), -100)).source,
                           without.source)  # no label (-100): as without
    assert gained >= 10
