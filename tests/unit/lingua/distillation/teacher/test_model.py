"""The teacher's forward as an inference forward (issue 27): document boundaries handed to flash kernels the way
transformers keeps packed documents apart, no KV cache, the decoder over chunks of rows (bit-identical on CPU)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never reach the hub

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lingua.distillation.args import DistillationArgs
from lingua.distillation.teacher.model import TeacherModel, document_positions, packed_document_kwargs

CPU = torch.device("cpu")


def packed_doc_ids(rows: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """[rows, S] non-decreasing document ids with a few documents per row (as the data loader packs them)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.rand(rows, seq_len, generator=generator) < 0.2
    starts[:, 0] = False
    return starts.long().cumsum(dim=1) + 7  # ids need not start at 0


def test_the_flash_kwargs_are_what_transformers_derives_for_a_packed_sequence():
    """transformers 5.23 finds packed documents from position ids only at batch size 1; the kwargs the teacher
    passes are exactly those it derives for the rows packed into one sequence, so its varlen path keeps them apart."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    doc_ids = packed_doc_ids(3, 40)
    kwargs = packed_document_kwargs(doc_ids)
    positions = kwargs["position_ids"]
    assert positions.shape == (1, 3 * 40) and torch.equal(positions, document_positions(doc_ids).reshape(1, -1))
    assert bool(_is_packed_sequence(positions, batch_size=1))
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions)
    assert torch.equal(kwargs["cu_seq_lens_q"], cu_q) and torch.equal(kwargs["cu_seq_lens_k"], cu_k)
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == int(max_q) == int(max_k)
    assert isinstance(kwargs["max_length_q"], int)  # flash_attn_varlen_func wants a Python int
    # Every row starts a segment, even when its first document continues the last row's id.
    same = torch.zeros(2, 8, dtype=torch.long)
    assert packed_document_kwargs(same)["cu_seq_lens_q"].tolist() == [0, 8, 16]
    # At batch size rows > 1, transformers would not look at the position ids: plain causal flash over whole rows.
    assert not _is_packed_sequence(document_positions(doc_ids), batch_size=3)


def _sdpa_heads(q, k, v, scale):  # [T, H, D] each (k, v may have fewer heads) -> [T, H, D], causal
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.fixture
def cpu_flash(monkeypatch):
    """transformers' flash-attention path on CPU: its own `_flash_attention_forward` decides dense or varlen, the
    kernels are SDPA stand-ins; returns the calls ('dense' or the varlen segment starts)."""
    import transformers.modeling_flash_attention_utils as fa

    calls = []

    def flash_fn(q, k, v, causal=True, softmax_scale=None, **_):  # [B, S, H, D]
        calls.append("dense")
        return torch.stack([_sdpa_heads(q[b], k[b], v[b], softmax_scale) for b in range(q.shape[0])])

    def varlen_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, softmax_scale=None, max_seqlen_q=None,
                  max_seqlen_k=None, **_):  # [T, H, D]
        calls.append(cu_seqlens_q.tolist())
        assert causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
        bounds = cu_seqlens_q.tolist()
        assert max(b - a for a, b in zip(bounds, bounds[1:])) <= max_seqlen_q
        return torch.cat([_sdpa_heads(q[a:b], k[a:b], v[a:b], softmax_scale) for a, b in zip(bounds, bounds[1:])])

    def process(query_length=None, key_length=None, is_causal=True, softmax_scale=None, max_seqlen_q=None,
                max_seqlen_k=None, **_):
        kwargs = dict(causal=is_causal, softmax_scale=softmax_scale)
        if max_seqlen_q is not None:
            kwargs.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return kwargs

    monkeypatch.setattr(fa, "lazy_import_flash_attention",
                        lambda *a, **k: ((flash_fn, varlen_fn, None, None, None), (process, process)))
    return calls


def test_a_flash_teacher_keeps_the_documents_of_several_rows_apart(tiny_teacher, cpu_flash):
    """Through transformers' own flash code path: packed rows of documents give the same hidden states as SDPA with
    the block-diagonal mask; what the teacher passed before (restarting position ids at batch size rows) ran
    dense causal flash over whole rows, earlier documents in view."""
    sdpa = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32",
                                         attn_implementation="sdpa"), CPU)
    flash = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32",
                                          attn_implementation="sdpa"), CPU)
    flash.model.config._attn_implementation = "flash_attention_2"
    doc_ids = packed_doc_ids(6, 32, seed=1)
    tokens = torch.randint(0, sdpa.vocab_size, (6, 32), generator=torch.Generator().manual_seed(2))
    expected = sdpa.hidden_states(tokens, doc_ids)
    got = flash.hidden_states(tokens, doc_ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    rows = flash.logits_chunk_rows(32)
    chunk_starts = packed_document_kwargs(doc_ids[:rows])["cu_seq_lens_q"].tolist()
    assert cpu_flash and all(call != "dense" for call in cpu_flash) and cpu_flash[0] == chunk_starts
    # The old call: [rows, S] with restarting position ids and no mask reaches the dense kernel.
    cpu_flash.clear()
    with torch.inference_mode():
        old = flash.model.get_decoder()(input_ids=tokens, position_ids=document_positions(doc_ids),
                                        use_cache=False).last_hidden_state
    assert set(cpu_flash) == {"dense"}
    assert not torch.allclose(old, expected, atol=1e-3)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("documents", [False, True])
def test_the_decoder_over_chunks_of_rows_is_bit_identical_and_builds_no_kv_cache(tiny_teacher, monkeypatch,
                                                                                 attn_implementation, documents):
    from transformers import cache_utils

    built = []
    original = cache_utils.DynamicCache.__init__

    def spy(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", spy)
    args = DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32",
                            attn_implementation=attn_implementation, logits_chunk_rows=7)
    teacher = TeacherModel(args, CPU)
    tokens = torch.randint(0, teacher.vocab_size, (7, 24), generator=torch.Generator().manual_seed(3))
    doc_ids = packed_doc_ids(7, 24, seed=4) if documents else None
    whole = teacher.hidden_states(tokens, doc_ids)  # one chunk
    for rows in (1, 2, 3):
        teacher.args = DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32",
                                        attn_implementation=attn_implementation, logits_chunk_rows=rows)
        assert torch.equal(teacher.hidden_states(tokens, doc_ids), whole), rows
    assert built == []
    with torch.inference_mode():
        teacher.model.get_decoder()(input_ids=tokens)  # the config's default: a cache (the spy sees it)
    assert built == ["DynamicCache"]



def test_a_flex_teacher_gets_a_block_mask_not_a_dense_one(tiny_teacher, monkeypatch):
    """attn_implementation=flex_attention: the decoder gets a BlockMask of the documents (transformers passes a
    4D mask through as it is) and no [rows, 1, S, S] tensor is built. (The forward itself compiles flex with
    Triton/inductor: its numbers are the GPU check's.)"""
    from torch.nn.attention.flex_attention import BlockMask

    import lingua.distillation.teacher.model as teacher_module
    from lingua.transformer import doc_causal_bool_mask

    teacher = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="fp32",
                                            attn_implementation="sdpa"), CPU)
    teacher.model.config._attn_implementation = "flex_attention"
    seen = []

    def decoder(input_ids, **kwargs):
        seen.append(kwargs)
        return SimpleNamespace(last_hidden_state=torch.zeros(*input_ids.shape, 4))

    monkeypatch.setattr(teacher.model, "get_decoder", lambda: decoder)
    monkeypatch.setattr(teacher_module, "document_causal_mask", lambda *a: pytest.fail("a dense mask was built"))
    doc_ids = packed_doc_ids(3, 200, seed=5)
    teacher.hidden_states(torch.zeros(3, 200, dtype=torch.long), doc_ids)
    (kwargs,) = seen
    mask = kwargs["attention_mask"]
    assert isinstance(mask, BlockMask) and kwargs["use_cache"] is False
    assert torch.equal(kwargs["position_ids"], document_positions(doc_ids))
    # What the kernel sees: the mask_mod over the blocks the tables list equals the dense document mask.
    dense = torch.stack([torch.stack([mask.mask_mod(torch.tensor(b), 0, q, torch.arange(200)) for q in range(200)])
                         for b in range(3)])
    assert torch.equal(dense, doc_causal_bool_mask(doc_ids)[:, 0])


def test_teacher_logits_are_fp32_and_the_fp32_gemm_probe_says_no_on_cpu(tiny_teacher):
    """Issue 27 item 2: the fp32-output GEMM (`torch.mm(..., out_dtype=float32)`) has no CPU kernel, so the probe
    says no there and the head runs as before (its numbers on a GPU: tests/gpu/test_gpu_teacher.py)."""
    from lingua.distillation.loss.fused import multiplies_into_fp32

    assert not multiplies_into_fp32(CPU, torch.bfloat16) and not multiplies_into_fp32(CPU, torch.float32)
    teacher = TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="bf16"), CPU)
    hidden = torch.randn(2, 8, teacher.model.config.hidden_size).to(torch.bfloat16)
    logits = teacher.logits(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, teacher.model.get_output_embeddings()(hidden).float())
