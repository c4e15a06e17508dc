"""The online road's pieces without processes: the handshake with distillation.cross_tokenizer, the kd_weight on
the wire, the refusals (config, an unreadable teacher tokenizer), and the students' kd/aligned statistic."""

from dataclasses import replace

import pytest
import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import BridgeSpec, HandshakeRecord, agreed_settings, check_handshake
from lingua.distillation.cross_tokenizer.teacher_side import load_cross_tokenizer
from lingua.distillation.loss.mixture import head_loss_path, teachers_head_loss
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import ConfigError
from lingua.tokenizer import TokenizerArgs

CROSS = DistillationArgs(teacher_path="/teachers/a", cross_tokenizer=True)


def records(teacher_args, student_args, teacher_vocab=258, teacher_fingerprint=7, student_fingerprint=7):
    teacher = HandshakeRecord("teacher", 2, teacher_vocab, teacher_fingerprint, agreed_settings(teacher_args))
    students = [HandshakeRecord("student", rank, 258, student_fingerprint, agreed_settings(student_args),
                                max_bsz=2, max_seqlen=64) for rank in (0, 1)]
    return [HandshakeRecord.unpack(r.pack()) for r in (*students, teacher)]


def test_the_handshake_accepts_another_tokenizer_and_sizes_the_kd_weight():
    spec = check_handshake(records(CROSS, CROSS), CROSS)
    assert spec.kd_weight and spec.vocab_size == 258
    shapes = [shape for shape, _ in spec.payload_spec()]
    assert shapes == [(2, 64, 64), (2, 64, 64), (2, 64), (2, 64)]
    plain = BridgeSpec(2, 64, 258, "topk", 64, torch.bfloat16)
    assert len(plain.payload_spec()) == 3 and spec.response_bytes() == plain.response_bytes() + 2 * 64 * 4


def test_cross_tokenizer_is_an_agreed_setting():
    with pytest.raises(ConfigError, match=r"distillation\.cross_tokenizer is True on the teacher but False on the "
                                          r"student"):
        check_handshake(records(CROSS, replace(CROSS, cross_tokenizer=False)), CROSS)


def test_a_teacher_aligning_from_another_student_tokenizer_is_one_sentence():
    with pytest.raises(ConfigError) as caught:
        check_handshake(records(CROSS, CROSS, teacher_fingerprint=8), CROSS)
    assert str(caught.value) == ("Teacher rank 2 aligns from a student tokenizer (vocab 258) that is not student rank "
                                 "0's (vocab 258); give every rank the same data.tokenizer (one config for the whole "
                                 "job).")


def test_without_cross_tokenizer_the_refusal_names_the_key():
    plain = DistillationArgs(teacher_path="/teachers/a")
    with pytest.raises(ConfigError, match=r"or keep yours and set distillation\.cross_tokenizer=true\.$"):
        check_handshake(records(plain, plain, teacher_vocab=512, teacher_fingerprint=8), plain)


@pytest.mark.parametrize("change,words", [
    (dict(output="full"), "distillation.output=full: the full format is the teacher's log-probs over the student's "
                          "vocabulary, which a teacher of another tokenizer (distillation.cross_tokenizer=true) "
                          "cannot give; set output=topk or output=sampled"),
    (dict(output="sampled", uld_weight=0.5), "distillation.output=sampled: ULD compares the teacher's unmapped top-k "
                                             "entries, which sampled outputs do not carry; set distillation.output=topk"
                                             ", or uld_weight=0"),
    (dict(teacher_tp=2, n_teacher_ranks=2, output="sampled"),
     "distillation.teacher_tp=2: distillation.cross_tokenizer=true with output=sampled draws from the teacher's "
     "probabilities added up per student id over its whole vocabulary, of which a tensor-parallel rank holds a "
     "slice; set teacher_tp=1, or output=topk"),
])
def test_config_refusals(change, words):
    replace(CROSS, output="sampled").validate(enabled=False)  # the other sparse format is taken
    replace(CROSS, teacher_tp=2, n_teacher_ranks=2).validate(enabled=False)  # top-k from a tensor-parallel teacher
    with pytest.raises(ConfigError) as caught:
        replace(CROSS, **change).validate(enabled=False)
    assert words.split(": ", 1)[1] in str(caught.value) and words.split(":")[0].split("=")[0] in str(caught.value)


def test_an_unreadable_teacher_tokenizer_is_one_sentence(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as caught:
        load_cross_tokenizer(TokenizerArgs("bytes"), str(tmp_path / "empty"), None, None)
    sentence = str(caught.value)
    assert sentence.startswith(f"distillation.teacher_tokenizer='{tmp_path / 'empty'}' cannot be read as a Hugging "
                               f"Face tokenizer (")
    assert sentence.endswith("point it at the folder with the teacher's tokenizer.json, or leave it unset to use "
                             "the teacher's own.") and "\n" not in sentence


def test_kd_weight_travels_and_becomes_kd_aligned():
    outputs = TeacherOutputs("topk", torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int32),
                             torch.zeros(2, 3), kd_weight=torch.tensor([[1.0, 0, 1], [0, 0, 1]]))
    assert len(outputs.tensors()) == 4
    again = TeacherOutputs.from_tensors("topk", outputs.tensors())
    assert torch.equal(again.kd_weight, outputs.kd_weight) and again.to("cpu").kd_weight is not None
    labels = torch.tensor([[5, 5, -100], [5, 5, 5]])
    args = DistillationArgs()
    _, stats = teachers_head_loss(head_loss_path(args), torch.zeros(2, 3, 2), torch.zeros(6, 2), labels, [outputs],
                                  [outputs.kd_weight], 5, 0.5, args)
    assert stats["aligned"][0].item() == pytest.approx(0.4)  # 2 of 5 valid positions aligned (row 0's third masked)
    plain = replace(outputs, kd_weight=None)
    _, stats = teachers_head_loss(head_loss_path(args), torch.zeros(2, 3, 2), torch.zeros(6, 2), labels, [plain],
                                  [None], 5, 0.5, args)
    assert stats["aligned"][0].item() == 1.0  # every valid position has a target


def test_a_cross_tokenizer_request_carries_the_labels_past_the_windows():
    """The students send each row's last label after the tokens (a label outside the vocabulary, -100, as -1:
    none); where the tokenizers are the same, the request is as before."""
    from types import SimpleNamespace

    from lingua.distillation.online.bridge import HEADER_INTS, Op, RequestHeader
    from lingua.distillation.online.client import TeacherClient

    spec = check_handshake(records(CROSS, CROSS), CROSS)
    plain = BridgeSpec(2, 64, 258, "topk", 64, torch.bfloat16)
    assert spec.request_ints() == plain.request_ints() + 2 == HEADER_INTS + 2 * 64 + 2
    client = SimpleNamespace(spec=spec, n_words=258, pin=False, device=torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 10))
    request = TeacherClient._request(client, RequestHeader(Op.FORWARD, 3, 0, 2, 10, 0), tokens, None,
                                     torch.tensor([257, -100]))
    assert torch.equal(spec.token_grid(request)[:2, :10], tokens.int())
    assert spec.next_tokens(request).tolist() == [257, -1]
    alone = TeacherClient._request(client, RequestHeader(Op.FORWARD, 3, 0, 1, 10, 0), tokens[:1], None, None)
    assert spec.next_tokens(alone)[:1].tolist() == [-1]  # no labels given: none (the teacher reads bsz rows)


def test_an_unreadable_tokenizer_of_one_of_several_teachers_names_its_element(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^distillation\.teachers\[1\]\.tokenizer='.*empty' cannot be read as a "):
        load_cross_tokenizer(TokenizerArgs("bytes"), str(tmp_path / "empty"), None, None,
                             "distillation.teachers[1].tokenizer")


def test_sampled_targets_cross_the_wire(tiny_teacher):
    """output=sampled, online: what the teacher rank's `_cross_forward_rows` writes into two students' responses is
    read back by each student (`TeacherClient.payload`) as the draws `student_targets` gives for its rows, with the
    kd_weight, unmapped draws (id -1) included."""
    from types import SimpleNamespace

    from lingua.distillation.online.client import TeacherClient
    from lingua.distillation.online.server import TeacherServer
    from lingua.distillation.teacher.model import TeacherModel

    args = replace(CROSS, output="sampled", k=8, teacher_path=str(tiny_teacher))
    spec = check_handshake(records(args, args), args)
    teacher = TeacherModel(args, torch.device("cpu"))
    cross = load_cross_tokenizer(TokenizerArgs("bytes"), None, teacher.tokenizer, None)
    text = list("The teacher reads this text in its own tokens.".encode())
    tokens = torch.tensor([text[:20], text[20:40], text[5:25]])
    server = SimpleNamespace(cross=cross, teacher=teacher, spec=spec, args=args, bridge_ranks=[0, 1], nan_flags={},
                             leader=True, link=None,
                             generator=torch.Generator().manual_seed(3),
                             responses=[torch.zeros(spec.response_bytes(), dtype=torch.uint8) for _ in range(2)])
    server._write = lambda rank, outputs: TeacherServer._write(server, rank, outputs)
    headers = {0: SimpleNamespace(bsz=2, seqlen=20), 1: SimpleNamespace(bsz=1, seqlen=20)}
    TeacherServer._cross_forward_rows(server, [(0, None), (1, None)], headers, tokens, None, torch.tensor([32] * 3))
    batch = cross.teacher_batch(tokens, None, torch.tensor([32] * 3))
    hidden = teacher.hidden_states(batch.tokens, None)
    want = cross.student_targets(teacher, hidden, batch, "sampled", 8, spec.wire_dtype,
                                 torch.Generator().manual_seed(3))
    assert (want.ids[want.kd_weight.bool()] == -1).any() and (want.ids[want.kd_weight.bool()] >= 0).any()
    client = SimpleNamespace(spec=spec)
    for rank, rows in ((0, slice(0, 2)), (1, slice(2, 3))):
        got = TeacherClient.payload(client, server.responses[rank], headers[rank].bsz, 20)
        assert got.format == "sampled" and len(got.tensors()) == 4 and server.nan_flags[rank].item() == 0
        for a, b in zip(got.tensors(), want.tensors()):
            assert torch.equal(a, b[rows])
