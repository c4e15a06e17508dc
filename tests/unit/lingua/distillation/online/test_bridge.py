"""The bridge without processes: wire records, the handshake's checks, teacher loading and its errors."""

import os
import shutil
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

import pytest
import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import (
    HANDSHAKE_BYTES,
    HEADER_INTS,
    HandshakeRecord,
    Op,
    RequestHeader,
    ResponseStatus,
    agreed_settings,
    check_handshake,
)
from lingua.distillation.teacher.model import check_teacher_dir, load_teacher
from lingua.errors import ConfigError, PeerStopped, TeacherError, UserError

BRIDGE = [4, 5, 6]  # two students, then their teacher (global ranks)
TEACHER = 6
VOCAB, FINGERPRINT, MAX_POS = 512, 1234567, 4096
CPU = torch.device("cpu")


def records(teacher_args: DistillationArgs, student_args: list[DistillationArgs], status: int = 0, message: str = "",
            student_vocab: int = VOCAB, student_fingerprint: int = FINGERPRINT):
    """Handshake records as they come back from the all_gather (packed and unpacked like on the wire); the
    teacher's `status`: 0 loaded, 1 failed on a user error, 2 failed on a bug."""
    teacher = HandshakeRecord("teacher", TEACHER, VOCAB, FINGERPRINT, agreed_settings(teacher_args),
                              loaded=status == 0, bug=status == 2, max_positions=MAX_POS, message=message)
    students = [HandshakeRecord("student", rank, student_vocab, student_fingerprint, agreed_settings(args),
                                max_bsz=2 + i, max_seqlen=16 * (i + 1))
                for i, (rank, args) in enumerate(zip(BRIDGE, student_args))]
    return [HandshakeRecord.unpack(r.pack()) for r in (*students, teacher)]


def test_wire_records_round_trip_with_their_field_names():
    settings = agreed_settings(DistillationArgs(output="sampled", k=7, wire_dtype="fp16", temperature=1.5))
    record = HandshakeRecord("student", 5, 49152, 2**62 + 3, settings, max_bsz=4, max_seqlen=2048)
    packed = record.pack()
    assert packed.dtype == torch.uint8 and packed.numel() == HANDSHAKE_BYTES
    assert HandshakeRecord.unpack(packed) == record
    failed = HandshakeRecord("teacher", 6, 0, 0, settings, loaded=False, message="OSError: no such file é")
    assert HandshakeRecord.unpack(failed.pack()) == failed
    teacher = HandshakeRecord("teacher", 6, 512, 7, settings, heldout_ce=3.25, heldout_bpb=2.5)
    assert HandshakeRecord.unpack(teacher.pack()) == teacher  # the teacher's held-out CE and bits per byte
    assert HandshakeRecord.unpack(record.pack()).heldout_bpb is None
    bug = HandshakeRecord("teacher", 6, 0, 0, settings, loaded=False, bug=True, message="KeyError: 'x'")
    assert HandshakeRecord.unpack(bug.pack()) == bug and HandshakeRecord.unpack(failed.pack()).bug is False
    status = ResponseStatus(ok=True, teacher_preempt=True, busy_s=12.5, idle_s=0.25, peak_bytes=3 * 2**30)
    assert ResponseStatus.unpack(status.pack()) == status
    error = ResponseStatus(ok=False, message="teacher failed serving step 3: boom")
    assert ResponseStatus.unpack(error.pack()) == error
    bug = ResponseStatus(ok=False, message="teacher failed serving step 3: KeyError: 'x'", bug=True)
    assert ResponseStatus.unpack(bug.pack()) == bug and ResponseStatus.unpack(error.pack()).bug is False
    header = RequestHeader(Op.FORWARD, step=12, micro_step=1, bsz=4, seqlen=128, train_rank=3, bad_tokens=1)
    assert len(header.to_ints()) == HEADER_INTS and RequestHeader.from_ints(header.to_ints()) == header
    assert header.describe() == "op=FORWARD step=12 micro_step=1"


def test_agreeing_ranks_get_the_teachers_settings_and_the_largest_buffers():
    args = DistillationArgs(teacher_path="t", output="sampled", k=7, wire_dtype="fp16", temperature=1.5)
    spec = check_handshake(records(args, [args, args]), args)
    assert (spec.output, spec.k, spec.wire_dtype, spec.vocab_size) == ("sampled", 7, torch.float16, VOCAB)
    assert (spec.max_bsz, spec.max_seqlen) == (3, 32)


@pytest.mark.parametrize("field,teacher_value,student_value,words", [
    ("output", "topk", "sampled", "distillation.output is topk on the teacher but sampled on the student"),
    ("k", 64, 32, "distillation.k is 64 on the teacher but 32 on the student"),
    ("wire_dtype", "bf16", "fp32", "distillation.wire_dtype is bf16 on the teacher but fp32 on the student"),
    ("temperature", 1.0, 2.5, "distillation.temperature is 1.0 on the teacher but 2.5 on the student"),
])
def test_each_setting_mismatch_names_both_values_and_both_ranks(field, teacher_value, student_value, words):
    base = DistillationArgs(teacher_path="t")
    teacher_args, odd = replace(base, **{field: teacher_value}), replace(base, **{field: student_value})
    with pytest.raises(ConfigError) as caught:
        check_handshake(records(teacher_args, [teacher_args, odd]), odd)
    assert str(caught.value) == (f"Teacher rank 6 and student rank 5 disagree: {words}; give every rank the same "
                                 f"distillation settings (one config for the whole job).")


def test_several_mismatches_are_one_sentence_and_k_does_not_matter_for_full_logits():
    teacher_args = DistillationArgs(teacher_path="t", output="full", k=64)
    student_args = DistillationArgs(teacher_path="t", output="full", k=8, temperature=2.0, wire_dtype="fp32")
    with pytest.raises(ValueError, match=r"student rank 4 disagree: distillation\.wire_dtype is bf16 on the teacher "
                                         r"but fp32 on the student, distillation\.temperature is 1\.0 on the teacher "
                                         r"but 2\.0 on the student; give"):
        check_handshake(records(teacher_args, [student_args, student_args]), student_args)
    same_but_k = replace(teacher_args, k=8)
    assert check_handshake(records(teacher_args, [same_but_k, same_but_k]), same_but_k).output == "full"


def test_a_teacher_that_failed_to_load_is_reported_before_any_other_check():
    args = DistillationArgs(teacher_path="t")
    with pytest.raises(TeacherError, match=r"^Teacher rank 6 failed to load: teacher directory 't' is broken$"):
        check_handshake(records(args, [replace(args, k=3)] * 2, status=1, message="teacher directory 't' is broken"),
                        args)
    # A bug on the teacher: its traceback is its own; the others stop naming it (exit 1, not a user's error).
    with pytest.raises(PeerStopped, match=r"^Teacher rank 6 failed to load: KeyError: 'x'; its traceback is in "):
        check_handshake(records(args, [replace(args, k=3)] * 2, status=2,
                                message="KeyError: 'x'; its traceback is in dump/logs/rank_6.log"), args)


def test_tokenizers_of_the_same_size_but_different_tokens_do_not_match():
    args = DistillationArgs(teacher_path="/teachers/a")
    with pytest.raises(ConfigError, match=r"Student rank 4's tokenizer \(vocab 512\) does not match the teacher's "
                                         r"\(vocab 512, the same size but different tokens\) at /teachers/a\..*"
                                         r"data\.tokenizer\.path=/teachers/a"):
        check_handshake(records(args, [args, args], student_fingerprint=FINGERPRINT + 1), args)


@pytest.mark.timeout(60)
def test_a_bf16_teacher_loads_with_bf16_params_and_matches_fp32_within_bf16_tolerance(tiny_teacher):
    args = DistillationArgs(teacher_path=str(tiny_teacher))
    fp32, tokenizer = load_teacher(replace(args, teacher_dtype="fp32"), CPU)
    bf16, _ = load_teacher(replace(args, teacher_dtype="bf16"), CPU)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in bf16.parameters()) and not bf16.training
    tokens = torch.randint(0, len(tokenizer), (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = torch.log_softmax(fp32(tokens).logits.float(), -1)
        got = torch.log_softmax(bf16(tokens).logits.float(), -1)
    # bf16 keeps 8 mantissa bits: a few 1e-3 on these log-probs (~ -6.2), far below 2e-2; not bit-equal either.
    assert 0 < float((got - want).abs().max()) < 2e-2


@pytest.mark.timeout(60)
def test_every_local_load_failure_names_the_path_the_reason_and_the_prepare_commands(tiny_teacher, tmp_path):
    args = DistillationArgs(teacher_path="", teacher_dtype="fp32")
    teachers = tmp_path / "data" / "teachers"  # the demo's folder: only there do the prepare commands apply
    teachers.mkdir(parents=True)

    def failure(path: str) -> str:
        with pytest.raises(UserError) as caught:
            load_teacher(replace(args, teacher_path=path), CPU)
        text = str(caught.value)
        assert f"`python -m setup.prepare_teacher --out {path}`" in text, text
        assert f"`python -m setup.make_tiny_teacher --out {path}`" in text, text
        assert "transformers checkpoint directory" in text and "\n" not in text
        return text

    assert failure(str(teachers / "missing")).startswith(f"teacher path '{teachers / 'missing'}' does not exist; ")
    (teachers / "empty").mkdir()
    assert failure(str(teachers / "empty")).startswith(
        f"teacher directory '{teachers / 'empty'}' could not be loaded (ValueError: Unrecognized model in ")
    truncated = teachers / "truncated"
    shutil.copytree(tiny_teacher, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert failure(str(truncated)).startswith(
        f"teacher directory '{truncated}' could not be loaded (SafetensorError: Error while deserializing header: ")
    (truncated / "model.safetensors").write_bytes(weights)
    (truncated / "tokenizer.json").unlink()
    (truncated / "tokenizer_config.json").unlink()
    assert f"teacher directory '{truncated}' could not be loaded (" in failure(str(truncated))


@pytest.mark.timeout(60)
def test_a_mistyped_teacher_path_names_close_matches_and_no_toy_teacher(tmp_path):
    """A typo of the user's own teacher: the close names in its folder, and no command that would write the demo's
    SmolLM2 (or a tiny random model) at the typo."""
    models = tmp_path / "models"
    (models / "Llama-3.1-8B").mkdir(parents=True)
    (models / "Qwen2.5-7B").mkdir()
    typo = str(models / "Llama-3.1-8b")
    for check in (lambda: load_teacher(DistillationArgs(teacher_path=typo), CPU), lambda: check_teacher_dir(typo),
                  lambda: DistillationArgs(teacher_path=typo).validate(enabled=True)):
        with pytest.raises(UserError) as caught:
            check()
        text = str(caught.value)
        assert f"did you mean {models / 'Llama-3.1-8B'}?" in text, text
        assert "Qwen" not in text and "prepare_teacher" not in text and "make_tiny_teacher" not in text, text
        assert "at a transformers checkpoint directory" in text
    with pytest.raises(UserError, match=f"nor does its folder {tmp_path / 'nowhere'};"):
        check_teacher_dir(tmp_path / "nowhere" / "teacher")


@pytest.mark.timeout(60)
def test_a_relative_path_that_looks_like_a_hub_id_names_both_possibilities_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        load_teacher(DistillationArgs(teacher_path="models/x"), CPU)
    text = str(caught.value)
    assert text.startswith(f"teacher path 'models/x' is neither a local directory (nothing at {tmp_path / 'models/x'}) "
                           f"nor a hub model that could be loaded, and the Hugging Face hub is offline (HF_HUB_OFFLINE): ")
    assert "prepare_teacher" not in text  # not under data/teachers/: the demo's commands would write a toy there
    with pytest.raises(FileNotFoundError, match=r"`python -m setup.prepare_teacher --out data/teachers/smollm`"):
        load_teacher(DistillationArgs(teacher_path="data/teachers/smollm"), CPU)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_packed_row_with_document_ids_equals_separate_forwards_of_its_documents(tiny_teacher, attn_implementation):
    """model.attn_mask=doc_causal: the teacher sees each packed document as its own sequence, as the student does."""
    from lingua.distillation.teacher.model import TeacherModel

    teacher = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32",
                                            attn_implementation=attn_implementation), CPU)
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 2, 16]  # a 32-token row packing four documents
    docs = [torch.randint(0, teacher.vocab_size, (1, n), generator=generator) for n in lengths]
    row = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    packed = teacher.hidden_states(row, doc_ids)
    separate = torch.cat([teacher.hidden_states(doc) for doc in docs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)
    # Without document ids the later documents attend to the earlier ones: the check above has teeth.
    assert not torch.allclose(teacher.hidden_states(row)[:, lengths[0]:], separate[:, lengths[0]:], atol=1e-3)
    # And the sparse outputs the students receive agree too.
    wire = teacher.sparse_outputs(packed, "topk", 8, torch.float32, teacher.vocab_size)
    alone = teacher.sparse_outputs(separate, "topk", 8, torch.float32, teacher.vocab_size)
    torch.testing.assert_close(wire.values, alone.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(wire.ids, alone.ids)


def test_logits_chunk_rows_auto_is_four_on_cpu_and_sized_from_free_memory_on_gpu(tiny_teacher):
    from lingua.distillation.teacher.model import TeacherModel

    teacher = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32"), CPU)
    assert teacher.args.logits_chunk_rows == 0 and teacher.logits_chunk_rows(32) == 4  # the CPU default, as before
    hidden = torch.randn(6, 32, teacher.model.config.hidden_size)
    auto = teacher.sparse_outputs(hidden, "topk", 8, torch.float32, teacher.vocab_size)
    teacher.args = DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32", logits_chunk_rows=1)
    assert teacher.logits_chunk_rows(32) == 1  # an explicit value wins
    one_row = teacher.sparse_outputs(hidden, "topk", 8, torch.float32, teacher.vocab_size)
    assert torch.equal(auto.values, one_row.values) and torch.equal(auto.ids, one_row.ids)  # rows are independent
    # The GPU rule, on this teacher's numbers: a power of two of [S, V] fp32 rows, 4 tensors each, in 1/4 of the free memory.
    teacher.args = DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32")
    teacher.device, teacher.free_bytes = torch.device("cuda"), 10 * 2**30
    per_row = 2048 * teacher.vocab_size * 4 * 4
    assert teacher.logits_chunk_rows(2048) == 2 ** int(torch.tensor(10 * 2**30 / 4 / per_row).log2().floor())
    teacher.free_bytes, teacher.chunk_rows = 2**20, {}
    assert teacher.logits_chunk_rows(2048) == 1  # never fewer than one row


def test_a_negative_logits_chunk_rows_is_refused():
    with pytest.raises(ValueError, match=r"distillation.logits_chunk_rows=-1; use 0 \(auto"):
        DistillationArgs(logits_chunk_rows=-1).validate(enabled=False)


def test_an_unknown_loss_weight_grad_is_refused():
    with pytest.raises(ValueError, match=r"distillation.loss_weight_grad='blocks'; use one of accumulate, vocab_blocks"):
        DistillationArgs(loss_weight_grad="blocks").validate(enabled=False)
    DistillationArgs(loss_weight_grad="vocab_blocks").validate(enabled=False)


def test_loss_weight_grad_reaches_the_fused_ce_head():
    """distillation.loss_weight_grad=vocab_blocks trains through the same loss and gradients as the accumulator."""
    accumulated = _ce_head_step(DistillationArgs(loss_weight_grad="accumulate", loss_chunk_size=5))
    blocked = _ce_head_step(DistillationArgs(loss_weight_grad="vocab_blocks", loss_chunk_size=5))
    for blocked_value, accumulated_value in zip(blocked, accumulated):
        torch.testing.assert_close(blocked_value, accumulated_value)


def _ce_head_step(args: DistillationArgs):
    """(loss, grad of the hidden states, grad of the head, loss/ce) of one CE-only step through NoDistiller's head."""
    from lingua.distillation.distiller import NoDistiller

    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=generator), torch.randn(40, 8, generator=generator)
    labels = torch.randint(0, 40, (2, 6), generator=generator)
    distiller = NoDistiller(args)
    distiller.begin_step(0, 1.0)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = distiller.head_loss(labels, None, 12, None)(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad, distiller.step_metrics()["loss/ce"]


def test_auto_prefetch_looks_ahead_unless_the_ranks_oversubscribe_the_cores():
    from lingua.distillation.args import resolve_prefetch

    assert resolve_prefetch("auto", "cuda", 8, 16, 2) == (1, "auto: every rank has its own GPU")
    assert resolve_prefetch("auto", "cpu", 3, 1, 16)[0] == 1
    # The demo: 2 students + 1 teacher of one thread each on 2 cores, where look-ahead made it slower.
    prefetch, why = resolve_prefetch("auto", "cpu", 3, 1, 2)
    assert prefetch == 0 and why.startswith("auto: 3 ranks x 1 threads on 2 cores oversubscribe them")
    assert resolve_prefetch("auto", "cpu", 2, 4, 4)[0] == 0  # threads count too
    assert resolve_prefetch(2, "cpu", 3, 1, 2) == (2, "distillation.prefetch=2")  # an explicit value wins
    for bad in (3, -1, "always", True):
        with pytest.raises(ValueError, match="distillation.prefetch="):
            DistillationArgs(prefetch=bad).validate(enabled=False)


@pytest.mark.parametrize("output,k,refused", [("topk", 500, False), ("topk", 501, True), ("topk", 100000, True),
                                              ("sampled", 100000, False), ("full", 100000, False)])
def test_top_k_beyond_the_students_vocabulary_is_refused_at_the_handshake(output, k, refused):
    """The teacher's outputs are cut to the students' vocab (here 500 of the teacher's 512 rows): top-k needs k ids
    among them. Sampling draws with replacement, so any k is a valid sample; full sends no ids."""
    args = DistillationArgs(teacher_path="t", output=output, k=k, divergence="fkl")
    handshake = records(args, [args, args], student_vocab=500)
    if not refused:
        assert check_handshake(handshake, args).k == k
        return
    with pytest.raises(ValueError) as caught:
        check_handshake(handshake, args)
    assert str(caught.value) == (f"distillation.k={k} is more than the 500 token ids the top-k is taken from (the "
                                 f"students' vocabulary; teacher rank 6 has 512); set distillation.k <= 500.")


class FakeStream:
    """CUDA timing events without a GPU: recorded in order at `now`; an event is complete once it, or one recorded
    after it (one stream), was synchronized, and elapsed_time between incomplete events fails as on CUDA."""

    def __init__(self):
        self.now, self.recorded, self.completed, self.syncs = 0.0, 0, 0, 0

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, stream: FakeStream):
        self.stream, self.index, self.time = stream, None, None

    def record(self) -> None:
        self.index, self.time = self.stream.recorded, self.stream.now
        self.stream.recorded += 1

    def synchronize(self) -> None:
        self.stream.completed = max(self.stream.completed, self.index + 1)
        self.stream.syncs += 1

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert max(self.index, end.index) < self.stream.completed, "elapsed_time on an event not complete yet"
        return (end.time - self.time) * 1e3


def test_the_wait_clock_keeps_every_cuda_event_pair_until_a_log_step_reads_them():
    from lingua.distillation.online.client import WaitClock

    stream = FakeStream()
    clock = WaitClock(torch.device("cuda"), make_event=stream.event)

    def wait(seconds: float) -> None:
        start = clock.start()
        stream.now += seconds
        clock.stop(start)
        stream.now += 10.0  # compute between waits is not waiting

    clock.new_step()  # step 1, not a log step: its two waits are never read
    wait(0.25)
    wait(0.5)
    clock.new_step()  # step 2, a log step
    wait(1.0)
    assert stream.syncs == 0  # no host sync before the log step reads
    assert clock.read_step() == pytest.approx(1.0)  # this step's wait only
    assert clock.total_s == pytest.approx(1.75)  # step 1's pairs were kept and folded in, not dropped
    assert stream.syncs == 1  # one sync, on the newest event
    assert (clock.read_step(), clock.total_s) == (pytest.approx(1.0), pytest.approx(1.75))  # nothing counted twice
    clock.new_step()
    assert clock.read_step() == 0.0 and clock.total_s == pytest.approx(1.75)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_wait_clock_on_a_real_gpu_counts_unread_steps_in_the_total():
    from lingua.distillation.online.client import WaitClock

    clock = WaitClock(torch.device("cuda"))
    for _ in range(2):  # two steps of the same wait: a kernel that spins on the stream between the events
        clock.new_step()
        start = clock.start()
        torch.cuda._sleep(50_000_000)
        clock.stop(start)
    step_s = clock.read_step()  # only the second step is read
    assert step_s > 0
    assert clock.total_s == pytest.approx(2 * step_s, rel=0.2)


def test_loss_compile_reaches_the_fused_head_and_refuses_what_it_cannot_compile(monkeypatch):
    """distillation.loss_compile=true runs the fused CE head's chunks through the compiled math (traced with
    aot_eager here) with the same loss, grads and metric; a non-bool, or loss_compile without the fused loss, is
    refused."""
    from lingua.distillation.loss import compiled_chunk, fused as fused_loss

    monkeypatch.setattr(compiled_chunk, "BACKEND", "aot_eager")
    monkeypatch.setattr(compiled_chunk, "_compiled", {})
    chunks = []
    monkeypatch.setattr(fused_loss, "compiled_chunk_loss_and_grad",
                        lambda *args: chunks.append(1) or compiled_chunk.compiled_chunk_loss_and_grad(*args))
    eager = _ce_head_step(DistillationArgs(loss_chunk_size=5))
    compiled = _ce_head_step(DistillationArgs(loss_compile=True, loss_chunk_size=5))
    assert len(chunks) == 3  # 12 positions in chunks of 5: the last one padded
    for compiled_value, eager_value in zip(compiled, eager):
        torch.testing.assert_close(compiled_value, eager_value)
    with pytest.raises(ValueError, match="distillation.loss_compile='yes'; use auto, true or false"):
        DistillationArgs(loss_compile="yes").validate(enabled=False)
    with pytest.raises(ValueError, match="distillation.loss_compile=true; it compiles the fused loss"):
        DistillationArgs(loss_compile=True, fused_loss=False).validate(enabled=False)
    torch._dynamo.reset()


def test_loss_compile_auto_compiles_ce_alone_on_a_gpu():
    """loss_compile=auto (the default) compiles where the H100 bench measured a win at no more memory: the CE-only
    loss on a GPU. With a teacher (1.2-1.4x the peak compiled), on the CPU (slower), or without the fused loss: eager."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = DistillationArgs()
    assert auto.loss_compile == "auto"
    assert auto.compiles_loss(False, cuda) and not auto.compiles_loss(True, cuda)
    assert not auto.compiles_loss(False, cpu) and not auto.compiles_loss(True, cpu)
    assert not DistillationArgs(fused_loss=False).compiles_loss(False, cuda)
    assert DistillationArgs(loss_compile=True).compiles_loss(True, cpu)
    assert not DistillationArgs(loss_compile=False).compiles_loss(False, cuda)
    DistillationArgs(fused_loss=False).validate(enabled=False)  # auto never asks for the fused loss
