"""Export to Hugging Face Llama (from memory and from a DCP checkpoint) and sampling from a student."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from apps.main.export_hf import ExportArgs, export_checkpoint, export_to_hf, load_model_state_dict, main
from apps.main.generate import GenerateArgs, generate_text, generate_tokens, load_student, sample_next_token
from apps.main.transformer import LMTransformer, LMTransformerArgs
from lingua.args import to_dict
from lingua.tokenizer import ByteTokenizer

BYTE_VOCAB = ByteTokenizer().n_words
# The checkpoints here are written by one process without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_args(**overrides) -> LMTransformerArgs:
    # n_kv_heads < n_heads and a non-default theta: layout mistakes in q/k/RoPE show up as logit mismatches.
    values = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTE_VOCAB, max_seqlen=64,
                  rope_theta=5000.0, multiple_of=16, ffn_dim_multiplier=1.3, norm_eps=1e-6)
    values.update(overrides)
    return LMTransformerArgs(**values)


def build(args: LMTransformerArgs) -> LMTransformer:
    model = LMTransformer(args)
    model.init_weights()
    # Non-unit norm weights so a dropped or misnamed norm is visible in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.mul_(torch.linspace(0.5, 1.5, param.numel()))
    return model.eval()


def hf_logits(path, ids):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def make_hf_tokenizer(path):
    """A tiny word-level fast tokenizer saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(path)
    return len(words)


def save_dcp_checkpoint(model, args, root, step=10, tokenizer=None, data=None):
    """A checkpoint laid out like the trainer's: DCP {"model", "optim"} + params.json (`data`: more data.* keys)."""
    step_dir = root / f"{step:010d}"
    optim = {"state": {name: {"exp_avg": torch.zeros_like(p)} for name, p in model.named_parameters()},
             "param_groups": [{"lr": 1e-3}]}
    dcp.save({"model": model.state_dict(), "optim": optim}, checkpoint_id=str(step_dir))
    data = {"tokenizer": tokenizer or {"name": "bytes", "path": None}, **(data or {})}
    params = {"model": to_dict(args), "data": data}
    (step_dir / "params.json").write_text(json.dumps(params))
    return step_dir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tie", [False, True])
def test_export_round_trip_matches_hf_llama(tmp_path, tie):
    args = tiny_args(tie_embeddings=tie)
    model = build(args)
    out = export_to_hf(model.state_dict(), args, str(tmp_path / "hf"), bos_id=256, eos_id=257)
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["rope_parameters"]["rope_theta"] == 5000.0
    # transformers 4.x reads only the top-level key (without it: theta 10,000 and logits off by several units).
    assert config["rope_theta"] == 5000.0
    assert config["tie_word_embeddings"] is tie and config["eos_token_id"] == 257
    assert (out / "model.safetensors").is_file()
    ids = torch.randint(0, BYTE_VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
    torch.testing.assert_close(hf_logits(out, ids), ours, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(60)
def test_export_from_dcp_checkpoint_cli_and_generate(tmp_path):
    args = tiny_args()
    model = build(args)
    save_dcp_checkpoint(model, args, tmp_path / "checkpoints", step=10)
    # An unfinished save must not be picked as the latest step.
    (tmp_path / "checkpoints" / "0000000020.tmp").mkdir()

    state_dict = load_model_state_dict(tmp_path / "checkpoints" / "0000000010")
    assert set(state_dict) == set(model.state_dict())
    main([f"ckpt={tmp_path / 'checkpoints'}", f"out={tmp_path / 'hf'}"])
    ids = torch.randint(0, BYTE_VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), ours, atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 256

    # Greedy generation from the checkpoint equals greedy decoding of the in-memory model.
    text = generate_text(GenerateArgs(ckpt=str(tmp_path / "checkpoints"), prompt="ab", max_new_tokens=6,
                                      temperature=0.0, device="cpu"))
    prompt_ids = ByteTokenizer().encode("ab", add_bos=True, add_eos=False)
    expected = generate_tokens(model, prompt_ids, 6, temperature=0.0, eos_id=257)
    assert len(expected) >= 1
    assert text == ByteTokenizer().decode([t for t in expected if t != 257])
    # The export carries the byte tokenizer's Hugging Face form: generating from it gives the same text.
    assert load_student(str(tmp_path / "hf"), torch.device("cpu")).tokenizer.encode("ab", True, False) == prompt_ids
    assert generate_text(GenerateArgs(ckpt=str(tmp_path / "hf"), prompt="ab", max_new_tokens=6, temperature=0.0,
                                      device="cpu")) == text
    # An export without any tokenizer (written before tokenizers were exported) says so.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_student(str(tmp_path / "hf"), torch.device("cpu"))


@pytest.mark.timeout(60)
def test_export_with_hf_tokenizer_and_generate_from_export(tmp_path):
    vocab = make_hf_tokenizer(tmp_path / "tok")
    args = tiny_args(vocab_size=vocab, tie_embeddings=True)
    model = build(args)
    save_dcp_checkpoint(model, args, tmp_path / "ckpt", tokenizer={"name": "hf", "path": str(tmp_path / "tok")})
    out = export_checkpoint(ExportArgs(ckpt=str(tmp_path / "ckpt" / "0000000010"), out=str(tmp_path / "hf")))
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2

    from_ckpt = generate_text(GenerateArgs(ckpt=str(tmp_path / "ckpt"), prompt="the cat", max_new_tokens=5,
                                           temperature=0.0, device="cpu"))
    from_export = generate_text(GenerateArgs(ckpt=str(out), prompt="the cat", max_new_tokens=5,
                                             temperature=0.0, device="cpu"))
    assert from_ckpt == from_export
    assert set(from_ckpt.split()) <= {"hello", "world", "the", "cat", "sat", "<unk>"}


@pytest.mark.timeout(10)
def test_sampling_respects_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0]).log_softmax(-1)
    assert sample_next_token(logits, 0.0, 1.0) == 0
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.35, 0.25])
    # top_p=0.7: 0.4 alone is short of it, 0.4+0.35 reaches it, so the 0.25 token is never drawn.
    draws = [sample_next_token(probs.log(), 1.0, 0.7, generator) for _ in range(300)]
    assert set(draws) == {0, 1}
    draws = [sample_next_token(probs.log(), 1.0, 1.0, generator) for _ in range(300)]
    assert set(draws) == {0, 1, 2}


@pytest.mark.timeout(10)
def test_export_errors_are_readable(tmp_path):
    with pytest.raises(FileNotFoundError, match="ckpt="):
        export_checkpoint(ExportArgs(ckpt=str(tmp_path / "missing"), out=str(tmp_path / "out")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="params.json"):
        export_checkpoint(ExportArgs(ckpt=str(tmp_path / "empty"), out=str(tmp_path / "out")))
    args = tiny_args()
    state = build(args).state_dict()
    del state["layers.1.feed_forward.w2.weight"]
    with pytest.raises(ValueError, match="lacks 1 model tensors"):
        export_to_hf(state, args, str(tmp_path / "out"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("add_bos", [True, False])
def test_generate_starts_prompt_with_bos_only_when_training_did(tmp_path, add_bos):
    vocab = make_hf_tokenizer(tmp_path / "tok")
    args = tiny_args(vocab_size=vocab)
    model = build(args)
    save_dcp_checkpoint(model, args, tmp_path / "ckpt", tokenizer={"name": "hf", "path": str(tmp_path / "tok")},
                        data={"add_bos": add_bos})
    student = load_student(str(tmp_path / "ckpt"), torch.device("cpu"))
    assert student.add_bos is add_bos and student.tokenizer.bos_id == 1

    def greedy(ckpt):
        return generate_text(GenerateArgs(ckpt=str(ckpt), prompt="the cat sat", max_new_tokens=6, temperature=0.0,
                                          device="cpu"))

    prompts = {bos: student.tokenizer.encode("the cat sat", add_bos=bos, add_eos=False) for bos in (True, False)}
    expected = {bos: student.tokenizer.decode(generate_tokens(model, ids, 6, temperature=0.0, eos_id=2))
                for bos, ids in prompts.items()}
    assert expected[True] != expected[False]  # this prompt tells the two framings apart
    assert greedy(tmp_path / "ckpt") == expected[add_bos]
    # The export carries the training config, so generating from it frames the prompt the same way.
    out = export_checkpoint(ExportArgs(ckpt=str(tmp_path / "ckpt"), out=str(tmp_path / "hf")))
    assert json.loads((out / "training_params.json").read_text())["data"]["add_bos"] is add_bos
    assert load_student(str(out), torch.device("cpu")).add_bos is add_bos
    assert greedy(out) == expected[add_bos]
