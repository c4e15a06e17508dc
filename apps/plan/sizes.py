"""Sizes: the teacher's from its config.json (`TeacherShape`), the student's FLOPs per token as the trainer counts."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from apps.main.transformer import get_num_flop_per_token
from apps.plan.args import REQUIRED_KEYS, PlanArgs
from lingua.args import format_value, require
from lingua.errors import DataError, MissingPathError


@dataclass(frozen=True)
class TeacherShape:
    """What the planner needs of a teacher's config.json (its text config's for a multimodal one)."""

    path: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool
    mlp_bias: bool
    max_positions: Optional[int]

    def parameters(self, tp: int = 1) -> int:
        """Parameters on the first rank of a replica of `tp` ranks (the largest share; all of them with tp=1).
        Sharded as torch's plan shards them: vocabulary rows, q/k/v/gate/up output rows and o/down input
        columns split `tp` ways (torch.chunk sizes), norms and the biases of o/down replicated."""
        q, kv, ffn = ceil_div(self.heads * self.head_dim, tp), ceil_div(self.kv_heads * self.head_dim, tp), \
            ceil_div(self.intermediate, tp)
        layer = self.hidden * (2 * q + 2 * kv + 3 * ffn) + 2 * self.hidden  # q, o, k, v, gate/up/down; 2 norms
        layer += (q + 2 * kv + self.hidden) if self.attention_bias else 0
        layer += (2 * ffn + self.hidden) if self.mlp_bias else 0
        vocab_rows = ceil_div(self.vocab, tp) * self.hidden
        return vocab_rows * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def forward_flops_per_token(self, seq_len: int) -> int:
        """2 x the matmul parameters (the input embedding is a lookup; a tied head multiplies) plus attention's
        scores and values: a third of the trainer's training count for the same model."""
        matmul = self.parameters() - (0 if self.tied else self.vocab * self.hidden)
        return 2 * matmul + 4 * self.layers * self.heads * self.head_dim * seq_len


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def significant(value: float) -> float:
    """`value` to 4 significant digits, for the JSON (hours of a tiny run are not 0.0)."""
    return float(f"{value:.4g}")


def teacher_config_path(args: PlanArgs) -> Path:
    """teacher_config=, else the config.json in distillation.teacher_path; a sentence when there is neither."""
    if args.teacher_config:
        return Path(args.teacher_config).expanduser()
    require(bool(args.distillation.teacher_path), "teacher_config", args.teacher_config,
            "the config names no distillation.teacher_path: pass teacher_config=<the teacher's config.json> "
            "(configs/teachers/ holds Llama 3.1 8B and 70B and SmolLM2-135M)")
    return Path(args.distillation.teacher_path).expanduser() / "config.json"


def read_teacher_shape(path: Path) -> TeacherShape:
    """The teacher's sizes from its config.json; a missing file or key is one sentence naming the file."""
    if not path.is_file():
        raise MissingPathError(f"The teacher's config {path} does not exist; pass teacher_config=<its config.json> "
                                f"(configs/teachers/ holds Llama 3.1 8B and 70B and SmolLM2-135M), or point "
                                f"distillation.teacher_path at a local checkpoint directory.")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"The teacher's config {path} is not JSON ({err}); pass a transformers config.json.") from None
    if isinstance(config, dict) and "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal checkpoint: the language model's sizes
    if not isinstance(config, dict):
        raise DataError(f"The teacher's config {path} is not a JSON object; pass a transformers config.json.")
    for key in REQUIRED_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"The teacher's config {path} has {key}={format_value(value)}; the planner needs "
                             f"{', '.join(REQUIRED_KEYS)} as positive integers.")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or hidden // heads
    max_positions = config.get("max_position_embeddings")
    return TeacherShape(str(path), str(config.get("model_type", "unknown")), hidden, config["num_hidden_layers"],
                        heads, kv_heads, head_dim, config["intermediate_size"], config["vocab_size"],
                        bool(config.get("tie_word_embeddings", False)), bool(config.get("attention_bias", False)),
                        bool(config.get("mlp_bias", False)), max_positions if isinstance(max_positions, int) else None)


def student_flops_per_token(args: PlanArgs, n_params: int) -> int:
    """Training FLOPs per student token, as the trainer counts them for its MFU."""
    model = args.model
    matmul = n_params - (0 if model.tie_embeddings else model.vocab_size * model.dim)
    return get_num_flop_per_token(matmul, model.n_layers, model.dim, args.data.seq_len)
