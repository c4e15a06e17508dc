"""The student transformer: shapes, causality, document masking, GQA, attention kernels, meta-device init."""

import math

import pytest
import torch

from apps.main.transformer import LMTransformer, LMTransformerArgs, get_no_recompute_ops, get_num_flop_per_token
from lingua.transformer import (
    apply_rotary,
    attention,
    doc_causal_block_mask,
    doc_causal_bool_mask,
    doc_seqlens,
    flex_attention,
    resolve_attn_impl,
)

VOCAB = 97


def tiny_args(**overrides) -> LMTransformerArgs:
    values = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seqlen=32, rope_theta=5000.0,
                  multiple_of=16)
    values.update(overrides)
    return LMTransformerArgs(**values)


def build(args: LMTransformerArgs) -> LMTransformer:
    model = LMTransformer(args)
    model.init_weights()
    return model.eval()


def tokens(bsz: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (bsz, seq_len), generator=torch.Generator().manual_seed(seed))


def reference_attention(q, k, v, doc_ids):
    """Loops-and-softmax attention in float64 over [B, S, H, D], kv heads shared by consecutive query heads."""
    bsz, seq_len, n_heads, head_dim = q.shape
    n_rep = n_heads // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(bsz):
        for h in range(n_heads):
            scores = q[b, :, h].double() @ k[b, :, h // n_rep].double().T / math.sqrt(head_dim)
            for i in range(seq_len):
                for j in range(seq_len):
                    if j > i or doc_ids[b, i] != doc_ids[b, j]:
                        scores[i, j] = float("-inf")
            out[b, :, h] = torch.softmax(scores, dim=-1) @ v[b, :, h // n_rep].double()
    return out


@pytest.mark.timeout(30)
def test_logits_shape_and_finite():
    model = build(tiny_args())
    logits = model(tokens(3, 17))
    assert logits.shape == (3, 17, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.timeout(30)
def test_future_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = build(tiny_args())
    ids = tokens(2, 16)
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], atol=1e-6, rtol=0)
    assert (before[:, 10:] - after[:, 10:]).abs().max() > 1e-3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("attn_impl", ["auto", "sdpa", "flex", "xformers"])  # all but sdpa fall back to it on CPU
def test_doc_causal_documents_do_not_see_each_other(attn_impl):
    model = build(tiny_args(attn_mask="doc_causal", attn_impl=attn_impl))
    ids = tokens(2, 16, seed=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 4 + [2] * 3], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids)
        for b, (start, end) in [(0, (0, 5)), (0, (5, 16)), (1, (0, 9)), (1, (9, 13)), (1, (13, 16))]:
            # RoPE is relative, so a document alone at position 0 must give the same logits as packed.
            alone = model(ids[b:b + 1, start:end])
            torch.testing.assert_close(packed[b:b + 1, start:end], alone, atol=2e-5, rtol=1e-5)
        # Without doc_ids the same model is plainly causal: later documents see earlier ones.
        plain = model(ids)
    assert (plain[0, 5:] - packed[0, 5:]).abs().max() > 1e-3
    torch.testing.assert_close(plain[0, :5], packed[0, :5], atol=1e-6, rtol=0)


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_kernels_match_reference():
    generator = torch.Generator().manual_seed(3)
    bsz, seq_len, n_heads, n_kv_heads, head_dim = 2, 12, 4, 2, 16
    q = torch.randn(bsz, seq_len, n_heads, head_dim, generator=generator)
    k = torch.randn(bsz, seq_len, n_kv_heads, head_dim, generator=generator)
    v = torch.randn(bsz, seq_len, n_kv_heads, head_dim, generator=generator)
    doc_ids = torch.tensor([[0] * 4 + [1] * 3 + [2] * 5, [0] * 12], dtype=torch.int32)
    expected = reference_attention(q, k, v, doc_ids).float()

    torch.testing.assert_close(attention(q, k, v, doc_causal_bool_mask(doc_ids)), expected, atol=1e-5, rtol=1e-5)
    if flex_attention is not None:  # eager flex runs on CPU; on GPU the same mask is compiled
        torch.testing.assert_close(attention(q, k, v, doc_causal_block_mask(doc_ids)), expected, atol=1e-5, rtol=1e-5)
    # One document per row is plain causal attention.
    single_doc = torch.zeros_like(doc_ids)
    torch.testing.assert_close(attention(q, k, v, None), reference_attention(q, k, v, single_doc).float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(flex_attention is None, reason="this torch build has no flex_attention")
@pytest.mark.parametrize("seq_len", [128, 200, 515])
def test_the_document_block_mask_equals_create_block_masks_without_a_dense_mask(seq_len, monkeypatch):
    """Issue 27 item 11: the BlockMask from the documents' per-block spans has create_block_mask's tables exactly
    (partial and full blocks, both directions), and torch's dense create_mask is never called."""
    import torch.nn.attention.flex_attention as flex

    for seed, rate in enumerate((0.0, 0.002, 0.02, 0.2)):
        starts = torch.rand(3, seq_len, generator=torch.Generator().manual_seed(seed)) < rate
        starts[:, 0] = False
        doc_ids = starts.long().cumsum(dim=1) + seed

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        reference = flex.create_block_mask(mask_mod, 3, None, seq_len, seq_len, device="cpu")
        with monkeypatch.context() as patched:
            patched.setattr(flex, "create_mask", lambda *a, **k: pytest.fail("a dense [B, H, S, S] mask was built"))
            built = doc_causal_block_mask(doc_ids)
        assert built.seq_lengths == reference.seq_lengths == (seq_len, seq_len)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(built, name), getattr(reference, name)), (seed, name)


@pytest.mark.timeout(10)
def test_doc_seqlens_and_cpu_fallback():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert doc_seqlens(doc_ids) == [2, 3, 1, 6]
    # flex needs CUDA; on CPU the explicit-mask SDPA path runs instead.
    assert resolve_attn_impl("flex", torch.device("cpu")) == "sdpa"
    assert resolve_attn_impl("sdpa", torch.device("cuda")) == "sdpa"


@pytest.mark.timeout(10)
def test_auto_attention_is_flex_on_cuda_when_it_compiles(monkeypatch, caplog):
    import importlib.util

    from lingua import transformer

    cuda = torch.device("cuda")  # a device object only; no GPU needed
    assert resolve_attn_impl("auto", torch.device("cpu")) == "sdpa"  # CPU: the masked SDPA path, as before
    real_find_spec = importlib.util.find_spec
    for triton in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec("json") if triton else None) if name == "triton"
                            else real_find_spec(name, *a))
        transformer._warn_once.cache_clear()
        with caplog.at_level("WARNING", logger="lingua.transformer"):
            chosen = resolve_attn_impl("auto", cuda)
        assert chosen == ("flex" if triton and flex_attention is not None else "sdpa")
        assert ("dense [B, 1, S, S] mask" in caplog.text) == (chosen == "sdpa")
        caplog.clear()


@pytest.mark.timeout(10)
@pytest.mark.skipif(flex_attention is None, reason="this torch build has no flex_attention")
def test_heads_too_small_for_flex_use_sdpa_on_cuda_with_one_warning(monkeypatch, caplog):
    """flex_attention's GPU kernels refuse heads under 16 dimensions (tiny test models have 8): auto and an explicit
    flex fall back to the masked SDPA path with a warning, instead of failing in the first forward."""
    import importlib.util

    from lingua import transformer

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: real_find_spec("json") if name == "triton" else real_find_spec(name, *a))
    transformer._warn_once.cache_clear()
    cuda = torch.device("cuda")  # a device object only; no GPU needed
    with caplog.at_level("WARNING", logger="lingua.transformer"):
        assert resolve_attn_impl("auto", cuda, head_dim=16) == "flex"
        assert [resolve_attn_impl(impl, cuda, head_dim=8) for impl in ("auto", "flex", "auto")] == ["sdpa"] * 3
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == 1 and "at least 16 dimensions on GPU (this model has 8" in warnings[0], warnings
    assert resolve_attn_impl("auto", torch.device("cpu"), head_dim=8) == "sdpa"


@pytest.mark.timeout(10)
def test_xformers_missing_falls_back_with_one_warning(monkeypatch, caplog):
    import importlib.util

    from lingua import transformer

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xformers" else real_find_spec(name, *a))
    transformer._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="lingua.transformer"):
        on_gpu = resolve_attn_impl("xformers", torch.device("cuda"))  # a device object only; no GPU needed
        on_cpu = resolve_attn_impl("xformers", torch.device("cpu"))
    assert on_gpu == resolve_attn_impl("flex", torch.device("cuda")) and on_cpu == "sdpa"
    assert sum("xformers is not installed" in r.message for r in caplog.records) == 1


@pytest.mark.timeout(30)
def test_gqa_equals_multi_head_with_repeated_kv():
    gqa = build(tiny_args(n_heads=4, n_kv_heads=2))
    mha = LMTransformer(tiny_args(n_heads=4, n_kv_heads=4)).eval()
    head_dim = 64 // 4
    state = gqa.state_dict()
    for i in range(2):
        for name in ("wk", "wv"):
            key = f"layers.{i}.attention.{name}.weight"
            # Query head h reads kv head h // n_rep: repeat each kv head's rows n_rep times, in place.
            state[key] = state[key].view(2, head_dim, 64).repeat_interleave(2, dim=0).reshape(4 * head_dim, 64)
    mha.load_state_dict(state)
    mha.rope.reset_parameters()
    assert gqa.layers[0].attention.wk.weight.shape == (2 * head_dim, 64)
    ids = tokens(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(30)
def test_meta_init_is_finite_deterministic_and_device_independent():
    def from_meta(seed):
        with torch.device("meta"):
            model = LMTransformer(tiny_args(seed=seed, init_std_factor="current_depth"))
        model.to_empty(device="cpu")
        model.init_weights()
        return model

    first, second, other = from_meta(7), from_meta(7), from_meta(8)
    direct = build(tiny_args(seed=7, init_std_factor="current_depth"))
    for name, tensor in first.state_dict().items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, second.state_dict()[name]), name
        assert torch.equal(tensor, direct.state_dict()[name]), name
    assert not torch.equal(first.tok_embeddings.weight, other.tok_embeddings.weight)
    # RoPE tables are buffers outside the state dict: they must be rebuilt too.
    torch.testing.assert_close(first.rope.cos, direct.rope.cos, atol=0, rtol=0)
    ids = tokens(1, 9)
    with torch.no_grad():
        torch.testing.assert_close(first(ids), direct(ids), atol=0, rtol=0)


@pytest.mark.timeout(30)
def test_init_std_scales_with_dim_and_depth():
    model = LMTransformer(tiny_args(dim=128, n_layers=3, init_std_factor="current_depth", multiple_of=64))
    model.init_weights()
    base = 128 ** -0.5
    # A normal cut at 3 std has std ~0.9866 of the untruncated one.
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(base * 0.9866, rel=0.05)
    assert model.layers[2].attention.wo.weight.std().item() == pytest.approx(base / math.sqrt(6) * 0.9866, rel=0.05)
    assert model.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(
        model.hidden_dim ** -0.5 / math.sqrt(2) * 0.9866, rel=0.05)
    assert torch.equal(model.layers[1].ffn_norm.weight, torch.ones(128))


@pytest.mark.timeout(30)
def test_tied_embeddings_share_storage_after_meta_init():
    with torch.device("meta"):
        model = LMTransformer(tiny_args(tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in build(tiny_args()).parameters())


@pytest.mark.timeout(10)
def test_rotary_is_a_rotation_of_halves():
    x = torch.randn(1, 3, 1, 8)
    cos, sin = torch.cos(torch.ones(3, 4)), torch.sin(torch.ones(3, 4))
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    # Dimension 0 pairs with dimension D/2 = 4.
    expected0 = x[..., 0] * cos[None, :, None, 0] - x[..., 4] * sin[None, :, None, 0]
    torch.testing.assert_close(rotated[..., 0], expected0)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("overrides, fragment", [
    (dict(dim=60, n_heads=8), "n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(attn_impl="triton"), "attn_impl"),
    (dict(init_std_factor="depth"), "init_std_factor"),
    (dict(vocab_size=-1), "vocab_size"),
])
def test_bad_config_raises_readable_error(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        LMTransformer(tiny_args(**overrides))


@pytest.mark.timeout(10)
def test_too_long_sequence_raises():
    model = build(tiny_args(max_seqlen=8))
    with pytest.raises(ValueError, match="max_seqlen"):
        model(tokens(1, 9))


@pytest.mark.timeout(10)
def test_flops_and_recompute_ops():
    assert get_num_flop_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128
    ops = get_no_recompute_ops()
    assert torch.ops.aten.mm.default in ops
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in ops
    assert torch.ops.aten._scaled_dot_product_efficient_attention.default in ops


def test_xformers_gets_the_documents_run_lengths_from_the_host_batch(monkeypatch):
    """Issue 27 item 10: with attn_impl=xformers the run lengths come from the host batch (`batch_documents`),
    never from doc_ids on the device (a device-to-host read per forward)."""
    import sys
    from types import SimpleNamespace

    import apps.main.transformer as app_transformer
    import lingua.transformer as lingua_transformer
    from apps.main.transformer import LMTransformer, batch_documents

    built = []

    class Stop(Exception):
        pass

    def from_seqlens(seqlens):
        built.append(list(seqlens))
        raise Stop

    fmha = SimpleNamespace(attn_bias=SimpleNamespace(BlockDiagonalCausalMask=SimpleNamespace(from_seqlens=from_seqlens)))
    monkeypatch.setitem(sys.modules, "xformers", SimpleNamespace(ops=SimpleNamespace(fmha=fmha)))
    monkeypatch.setitem(sys.modules, "xformers.ops", SimpleNamespace(fmha=fmha))
    for module in (app_transformer, lingua_transformer):
        monkeypatch.setattr(module, "resolve_attn_impl", lambda *a, **k: "xformers")
    monkeypatch.setattr(lingua_transformer, "doc_seqlens", lambda doc_ids: pytest.fail("doc_ids read on the device"))
    model = LMTransformer(tiny_args(attn_mask="doc_causal", attn_impl="xformers"))
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long),
             "doc_ids": torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])}
    documents = batch_documents(model, batch, torch.device("cpu"))
    assert documents["doc_seqlens"] == [2, 3, 1, 6] and torch.equal(documents["doc_ids"], batch["doc_ids"])
    with pytest.raises(Stop):
        model(batch["input_ids"], **documents)
    assert built == [[2, 3, 1, 6]]
    # Any other kernel: doc_ids alone, nothing counted on the host.
    monkeypatch.setattr(app_transformer, "resolve_attn_impl", lambda *a, **k: "flex")
    assert batch_documents(model, batch, torch.device("cpu")).keys() == {"doc_ids"}
    assert batch_documents(LMTransformer(tiny_args()), batch, torch.device("cpu")) == {}
