"""Export a student checkpoint to a Hugging Face `LlamaForCausalLM` directory.

    python -m apps.main.export_hf ckpt=dumps/run/checkpoints/0000001000 out=exports/run_1000 [dtype=bf16]

`ckpt` is one step directory (DCP shards + params.json) or the checkpoints root (its latest step is
taken). The result loads with `AutoModelForCausalLM.from_pretrained(out)`. Our RoPE already uses HF's
`rotate_half` layout, so q/k weights are copied without permutation.

Tokenizer: when the run used `data.tokenizer.name=hf`, that tokenizer is saved next to the weights. A bytes,
tiktoken or sentencepiece run gets its tokenizer's Hugging Face form (`Tokenizer.hf_backend`, transformers'
converters), checked to encode a probe text to the ids `lingua.tokenizer` gives, with the run's bos/eos: then
`AutoTokenizer.from_pretrained(out)(text)` is `encode(text, add_bos=data.add_bos, add_eos=False)`, and text that
spells a special token ("<|end_of_text|>") stays text, as in training. The training config is copied to
`training_params.json`, so tools reading the export (generation, evaluation) frame text the way training did.
"""

import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from apps.main.transformer import LMTransformerArgs
from lingua.args import dataclass_from_dict, parse_args
from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError, MissingPathError
from lingua.tokenizer import Tokenizer
from lingua.transformer import ffn_hidden_dim

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^\d{10}$")
# Wrapper prefixes that activation checkpointing / torch.compile add to parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAINING_PARAMS = "training_params.json"  # the checkpoint's params.json, inside an exported directory
# Encoded by both forms of a converted tokenizer before it is saved: code, spaces, accents, CJK, emoji, a special.
PROBE_TEXTS = ("def distill(student, teacher):\n\treturn  teacher.logits - student.logits\n\n",
               "  Knowledge distillation, 12345 67890 3.14159; naïve café déjà vu.",
               "Ünïcödé 🎉🚀 漢字かな e\u0301 <|end_of_text|> </s> <s>   ")


@dataclass
class ExportArgs:
    ckpt: str = ""  # a checkpoint step directory, or a checkpoints root (latest step is used)
    out: str = ""  # output directory for the Hugging Face model
    dtype: str = "fp32"  # "fp32" | "bf16": dtype of the saved weights


def resolve_checkpoint_dir(path: str) -> Path:
    """The step directory to read: `path` itself if it holds params.json, else its latest finished step."""
    root = Path(path)
    if not root.is_dir():
        raise MissingPathError(f"checkpoint directory '{path}' does not exist; pass ckpt=<a checkpoint step "
                               f"directory or the run's checkpoints/ directory>.")
    if (root / "params.json").is_file():
        return root
    # `.tmp` step directories are unfinished saves and never match.
    steps = sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "params.json").is_file())
    if not steps:
        raise MissingPathError(f"'{path}' holds neither params.json nor finished step directories "
                               f"(<step:010d>/params.json); point ckpt at a checkpoint step directory.")
    return steps[-1]


def load_params(ckpt_dir: Path) -> dict:
    """The training config saved with the checkpoint (params.json)."""
    return json.loads((Path(ckpt_dir) / "params.json").read_text())


def trained_with_bos(params: dict) -> bool:
    """The run's data.add_bos (the trainer's default when its config does not say)."""
    from lingua.data import DataArgs

    return bool(params.get("data", {}).get("add_bos", DataArgs.add_bos))


def model_args_from_params(params: dict) -> LMTransformerArgs:
    """LMTransformerArgs from params.json's "model" entry."""
    if "model" not in params:
        raise DataError("params.json has no 'model' entry; is this a checkpoint written by apps.main.train?")
    return dataclass_from_dict(LMTransformerArgs, params["model"])


def clean_fqn(name: str) -> str:
    """Parameter name without the wrapper segments added by activation checkpointing or compile."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def load_model_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a DCP checkpoint, read on this one process; optimizer state is dropped."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / ".metadata").is_file():
        raise MissingPathError(f"'{ckpt_dir}' has no DCP .metadata file; point ckpt at a finished checkpoint step.")
    with tempfile.TemporaryDirectory() as tmp:
        consolidated = Path(tmp) / "consolidated.pt"
        dcp_to_torch_save(ckpt_dir, consolidated)
        # mmap: only the model tensors we copy out are read from disk, not the optimizer state.
        full = torch.load(consolidated, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(full.get("model"), dict):
            model = full["model"]
        else:
            model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
        state_dict = {clean_fqn(k): v.clone() for k, v in model.items() if isinstance(v, torch.Tensor)}
    if not state_dict:
        raise DataError(f"checkpoint '{ckpt_dir}' holds no 'model.*' tensors; is it a training checkpoint?")
    return state_dict


def to_hf_config(args: LMTransformerArgs, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 dtype: str = "fp32"):
    """The LlamaConfig describing the same network as `args`."""
    from transformers import LlamaConfig

    n_kv_heads = args.n_kv_heads or args.n_heads
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=ffn_hidden_dim(args.dim, args.ffn_dim_multiplier, args.multiple_of),
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=args.dim // args.n_heads,
        hidden_act="silu",
        max_position_embeddings=args.max_seqlen,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rope_theta)},
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        architectures=["LlamaForCausalLM"],
    )
    # transformers 4.x ignores rope_parameters and reads only a top-level rope_theta (defaulting to 10,000).
    config.rope_theta = float(args.rope_theta)
    return config


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: LMTransformerArgs) -> dict[str, torch.Tensor]:
    """Rename our parameters to LlamaForCausalLM's; every expected tensor must be present."""
    state_dict = {clean_fqn(k): v for k, v in state_dict.items()}
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    per_layer = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    for i in range(args.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    # A tied head is the embedding matrix, whether or not the checkpoint lists it twice.
    head = "tok_embeddings.weight" if args.tie_embeddings else "output.weight"
    missing = [ours for ours in [*names, head] if ours not in state_dict]
    if missing:
        raise DataError(f"the checkpoint lacks {len(missing)} model tensors (e.g. {missing[:3]}); its params.json "
                        f"model config does not match its weights.")
    hf = {theirs: state_dict[ours] for ours, theirs in names.items()}
    hf["lm_head.weight"] = state_dict[head]
    return hf


def hf_tokenizer_of(tokenizer: Tokenizer, add_bos: bool):
    """The Hugging Face tokenizer that encodes as `tokenizer` does: its backend, bos/eos named, bos added by
    `add_special_tokens` exactly when training added it, special-token text left as text (`split_special_tokens`);
    a probe text that encodes differently is one sentence (a DataError) instead of wrong task scores."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.hf_backend()
    specials = {f"{role}_token": backend.id_to_token(token_id)
                for role, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)) if token_id is not None}
    add_bos = add_bos and "bos_token" in specials
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **specials, add_bos_token=add_bos,
                                 add_eos_token=False, split_special_tokens=True,
                                 clean_up_tokenization_spaces=False)
    for text in PROBE_TEXTS:
        ours, theirs = tokenizer.encode(text, add_bos=add_bos, add_eos=False), hf(text)["input_ids"]
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise DataError(f"the Hugging Face form of this {type(tokenizer).__name__} encodes {text[:40]!r} "
                            f"differently from lingua.tokenizer (from token {first}: {ours[first:first + 4]} vs "
                            f"{theirs[first:first + 4]}); score this run by held-out perplexity (tasks=) and report "
                            f"the tokenizer file.")
    return hf


def export_to_hf(model_state_dict: dict[str, torch.Tensor], model_args: LMTransformerArgs, out_dir: str,
                 tokenizer_path: Optional[str] = None, dtype: str = "fp32", bos_id: Optional[int] = None,
                 eos_id: Optional[int] = None, training_params: Optional[dict] = None, hf_tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ the HF tokenizer at `tokenizer_path`, or the transformers tokenizer
    `hf_tokenizer`, + `training_params` as training_params.json) to `out_dir`.

    bos/eos ids default to the HF tokenizer's when `tokenizer_path` is given.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}.")
    tokenizer = hf_tokenizer
    if tokenizer_path is not None:
        if not Path(tokenizer_path).is_dir():
            raise MissingPathError(f"tokenizer directory '{tokenizer_path}' does not exist; fix data.tokenizer.path "
                                   f"or export without the tokenizer.")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        bos_id = tokenizer.bos_token_id if bos_id is None else bos_id
        eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
    config = to_hf_config(model_args, bos_id, eos_id, dtype)
    hf_state_dict = {k: v.detach().to("cpu") for k, v in to_hf_state_dict(model_state_dict, model_args).items()}
    model = LlamaForCausalLM(config)
    model.load_state_dict(hf_state_dict, strict=True)
    model.to(EXPORT_DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if training_params is not None:
        (out / TRAINING_PARAMS).write_text(json.dumps(training_params, indent=2) + "\n")
    logger.info(f"exported {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters to {out}")
    return out


def export_checkpoint(args: ExportArgs) -> Path:
    """Read the DCP checkpoint at args.ckpt and write the Hugging Face directory args.out (with a tokenizer)."""
    from lingua.tokenizer import TokenizerArgs, build_tokenizer

    if not args.ckpt or not args.out:
        raise ConfigError("pass both ckpt=<checkpoint directory> and out=<output directory>.")
    ckpt_dir = resolve_checkpoint_dir(args.ckpt)
    params = load_params(ckpt_dir)
    model_args = model_args_from_params(params)
    state_dict = load_model_state_dict(ckpt_dir)
    tokenizer_args = dataclass_from_dict(TokenizerArgs, params.get("data", {}).get("tokenizer", {}))
    if tokenizer_args.name == "hf":
        return export_to_hf(state_dict, model_args, args.out, tokenizer_path=tokenizer_args.path, dtype=args.dtype,
                            training_params=params)
    tokenizer = build_tokenizer(tokenizer_args)
    hf_tokenizer = hf_tokenizer_of(tokenizer, trained_with_bos(params))
    return export_to_hf(state_dict, model_args, args.out, dtype=args.dtype, bos_id=tokenizer.bos_id,
                        eos_id=tokenizer.eos_id, training_params=params, hf_tokenizer=hf_tokenizer)


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(ExportArgs, argv)
    out = export_checkpoint(args)
    print(f"exported {args.ckpt} -> {out}")


if __name__ == "__main__":
    run_cli(main)
