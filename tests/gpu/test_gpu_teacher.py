"""The teacher's forward on one GPU (issue 27): flash and flex kernels keep packed documents apart as SDPA does,
bf16 logits come out of the head's GEMM in fp32, the decoder over chunks of rows holds less memory, the
documents' BlockMask equals torch's own, a sticky CUDA error is recognised. Marked `cuda` (skipped without a
GPU, written to pass on one: `bash setup/gpu_check.sh`)."""

import subprocess
import sys

import pytest
import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.loss.fused import multiplies_into_fp32
from tests.gpu.gpus import needs_gpus
from tests.runs import ROOT

CUDA = torch.device("cuda", 0)


def packed_doc_ids(rows: int, seq_len: int, rate: float = 0.02, seed: int = 0) -> torch.Tensor:
    starts = torch.rand(rows, seq_len, generator=torch.Generator().manual_seed(seed)) < rate
    starts[:, 0] = False
    return (starts.long().cumsum(dim=1)).to(CUDA)


def teacher(tiny_teacher, **kwargs):
    from lingua.distillation.teacher.model import TeacherModel

    return TeacherModel(DistillationArgs(teacher_path=str(tiny_teacher), teacher_dtype="bf16", **kwargs), CUDA)


def flash_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return torch.cuda.is_available() and is_flash_attn_2_available()


@needs_gpus(1)
@pytest.mark.skipif(not flash_available(), reason="flash-attn 2 is not installed (pip install flash-attn)")
def test_a_flash_teacher_keeps_documents_packed_in_rows_apart_like_sdpa(tiny_teacher):
    """attn_implementation=flash_attention_2 with document ids over 8 rows: the hidden states and top-k outputs
    equal SDPA's with the block-diagonal mask within bf16 tolerance (before: flash over whole rows)."""
    flash, sdpa = teacher(tiny_teacher, attn_implementation="flash_attention_2"), teacher(tiny_teacher)
    doc_ids = packed_doc_ids(8, 256)
    tokens = torch.randint(3, 512, (8, 256), device=CUDA, generator=torch.Generator(CUDA).manual_seed(1))
    got, want = flash.hidden_states(tokens, doc_ids), sdpa.hidden_states(tokens, doc_ids)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    a, b = (t.sparse_outputs(h, "topk", 8, torch.float32, 512) for t, h in ((flash, got), (sdpa, want)))
    assert (a.ids == b.ids).float().mean() > 0.95
    torch.testing.assert_close(a.values, b.values, atol=5e-2, rtol=5e-2)
    # Without the boundaries, later documents would see earlier ones: the comparison has teeth.
    assert not torch.allclose(flash.hidden_states(tokens), want, atol=3e-2)


@needs_gpus(1)
def test_a_flex_teacher_keeps_documents_apart_like_sdpa(tiny_teacher):
    """attn_implementation=flex_attention gets the documents' BlockMask (no dense mask) and equals SDPA's."""
    flex, sdpa = teacher(tiny_teacher, attn_implementation="flex_attention"), teacher(tiny_teacher)
    doc_ids = packed_doc_ids(4, 384, seed=2)
    tokens = torch.randint(3, 512, (4, 384), device=CUDA, generator=torch.Generator(CUDA).manual_seed(3))
    torch.testing.assert_close(flex.hidden_states(tokens, doc_ids), sdpa.hidden_states(tokens, doc_ids),
                               atol=3e-2, rtol=3e-2)


@needs_gpus(1)
def test_bf16_teacher_logits_leave_the_gemm_in_fp32(tiny_teacher):
    """The head's GEMM writes fp32 (`torch.mm(..., out_dtype=float32)`): at logits of 8-32 its error against an
    fp64 product is far below bf16's rounding step (0.06-0.125), which the old `head(hidden).float()` had."""
    assert multiplies_into_fp32(CUDA, torch.bfloat16)
    model = teacher(tiny_teacher)
    weight = model.model.get_output_embeddings().weight
    hidden = torch.randn(4, 64, weight.shape[1], device=CUDA, generator=torch.Generator(CUDA).manual_seed(4))
    hidden = (hidden * 16 / (hidden @ weight.float().T).abs().mean()).to(torch.bfloat16)  # logits of about 16
    exact = hidden.double() @ weight.double().T
    got = model.logits(hidden)
    assert got.dtype == torch.float32
    rounded = model.model.get_output_embeddings()(hidden).float()
    error, rounding = (got.double() - exact).abs().max(), (rounded.double() - exact).abs().max()
    assert rounding > 0.03 and error < rounding / 8, (float(error), float(rounding))


@needs_gpus(1)
def test_the_decoder_over_chunks_of_rows_holds_less_memory_and_no_cache(tiny_teacher):
    """16 rows of 1,024 tokens with document masks (SDPA, dense per chunk): one row per chunk peaks well below
    all 16 at once, with the same hidden states (bf16 tolerance)."""
    doc_ids = packed_doc_ids(16, 1024, seed=5)
    tokens = torch.randint(3, 512, (16, 1024), device=CUDA, generator=torch.Generator(CUDA).manual_seed(6))
    peaks, states = {}, {}
    for rows in (16, 1):
        model = teacher(tiny_teacher, logits_chunk_rows=rows)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(CUDA)
        base = torch.cuda.memory_allocated(CUDA)
        states[rows] = model.hidden_states(tokens, doc_ids)
        torch.cuda.synchronize()
        peaks[rows] = torch.cuda.max_memory_allocated(CUDA) - base
        del model
    torch.testing.assert_close(states[1], states[16], atol=2e-2, rtol=2e-2)
    assert peaks[1] < peaks[16] / 4, peaks  # the [16, 1, 1024, 1024] masks (and a 16-row cache) are gone


@needs_gpus(1)
def test_the_documents_block_mask_equals_create_block_mask_on_cuda():
    """The BlockMask from the documents' spans has torch's own tables on the GPU too (ids non-decreasing)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from lingua.transformer import doc_causal_block_mask

    doc_ids = packed_doc_ids(2, 1000, rate=0.005, seed=7)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    want, got = create_block_mask(mask_mod, 2, None, 1000, 1000, device=CUDA), doc_causal_block_mask(doc_ids)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


STICKY_SCRIPT = """
import torch
from lingua.errors import is_sticky_device_error
try:
    torch.arange(4, device="cuda")[torch.tensor([7], device="cuda")].sum().item()  # a device-side assert
except Exception as err:
    print("sticky" if is_sticky_device_error(err) else f"not sticky: {type(err).__name__}: {err}")
"""


@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.timeout(120)
def test_a_device_side_assert_is_recognised_as_sticky():
    """torch's words for a device-side assert on this GPU are what `is_sticky_device_error` recognises (the teacher
    then leaves without a reply the poisoned context could not send)."""
    result = subprocess.run([sys.executable, "-c", STICKY_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                            timeout=100)
    assert result.stdout.strip().splitlines()[-1:] == ["sticky"], result.stdout[-2000:] + result.stderr[-2000:]
