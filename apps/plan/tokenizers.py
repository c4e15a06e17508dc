"""The teacher and the students' tokenizers in a plan: the keys its printed commands need, the students' vocabulary
(as the trainer takes it from their tokenizer), and the cross-tokenizer ratio (the teacher's tokens per student
token), measured where both tokenizers are on this machine.

The printed commands run as printed: a teacher path the config does not name comes from the plan's inputs (the
folder of `teacher_config=` where that folder is a checkpoint), else it is the visible placeholder
`<teacher checkpoint dir>`, which the trainer's validation names in one sentence. A student of the teacher's
tokenizer (distillation.cross_tokenizer=false, as the planner counts it) whose config names another tokenizer
(Meta Lingua's tiktoken) gets the teacher's: the commands set data.tokenizer, and a line says so and how to keep
the config's tokenizer instead.
"""

import json
import math
from pathlib import Path
from typing import Optional

from lingua.errors import ConfigError, MissingPathError

TEACHER_PLACEHOLDER = "<teacher checkpoint dir>"
SAMPLE_CHARS = 200_000  # of text to measure the ratio on: enough for two digits, seconds on a CPU


def teacher_dir(args, teacher_config: Optional[Path]) -> Optional[str]:
    """The teacher's checkpoint directory as the plan's inputs give it: distillation.teacher_path, else the folder of
    `teacher_config` where it holds a checkpoint (weights or a tokenizer beside its config.json), else None."""
    if args.distillation.teacher_path:
        return args.distillation.teacher_path
    if teacher_config is None or teacher_config.name != "config.json":
        return None
    folder = teacher_config.parent
    has_checkpoint = any(folder.glob("*.safetensors")) or (folder / "tokenizer.json").is_file()
    return str(folder) if has_checkpoint else None


def command_keys(args, teacher_config: Optional[Path]) -> dict:
    """{"teacher": the keys a distilling command adds for the teacher's path, "tokenizer": the keys every training
    command adds for the students' tokenizer, "notes": lines saying why} (module docstring)."""
    path = teacher_dir(args, teacher_config)
    shown = path or TEACHER_PLACEHOLDER
    teacher = [] if args.distillation.teacher_path else [f"distillation.teacher_path={shown}"]
    notes = [] if path else [f"teacher path: the commands say {TEACHER_PLACEHOLDER}: replace it with the teacher's "
                             f"checkpoint directory (or plan with distillation.teacher_path=<it>)"]
    tokenizer = []
    kd = args.distillation
    if not kd.cross_tokenizer and args.data.tokenizer.name != "hf":
        tokenizer = ["data.tokenizer.name=hf", f"data.tokenizer.path={kd.teacher_tokenizer or shown}"]
        notes.append(f"tokenizer: this plan gives the students the teacher's (vocab {args.model.vocab_size:,}; the "
                     f"commands set data.tokenizer, CE-only too, so both compare on one tokenizer); to keep your "
                     f"{args.data.tokenizer.name} tokenizer, plan with distillation.cross_tokenizer=true")
    return {"teacher": teacher, "tokenizer": tokenizer, "notes": notes}


def student_vocab(args, teacher_vocab: int) -> int:
    """The students' vocabulary as the trainer builds them (model.vocab_size=-1 is their tokenizer's size): the
    teacher's on its tokenizer; with distillation.cross_tokenizer=true, the config's own tokenizer's, read here
    (one sentence where it is not on this machine)."""
    if args.model.vocab_size != -1:
        return args.model.vocab_size
    if not args.distillation.cross_tokenizer:
        return teacher_vocab
    from lingua.tokenizer import build_tokenizer

    try:
        return build_tokenizer(args.data.tokenizer).n_words
    except (MissingPathError, OSError):
        raise ConfigError(f"distillation.cross_tokenizer=true keeps the students' own tokenizer, whose vocabulary the "
                          f"plan needs, but data.tokenizer.path={args.data.tokenizer.path} is not on this machine; "
                          f"point data.tokenizer.path at a copy of it, or pass model.vocab_size=<its vocabulary>."
                          ) from None


def sample_texts(args) -> tuple[list[str], str]:
    """Up to SAMPLE_CHARS of text and where from: the config's training data where its files are here, else this
    repository's documentation (English prose and code)."""
    from lingua.loading.documents import list_chunk_files

    texts, size = [], 0
    for source in args.data.sources:
        try:
            files = list_chunk_files(args.data.root_dir, source)
        except Exception:  # the data lives on the cluster: the docs below
            continue
        for line in files[0].open(errors="replace"):
            try:
                text = json.loads(line).get("text", "")
            except ValueError:
                continue
            texts.append(text)
            size += len(text)
            if size >= SAMPLE_CHARS:
                return texts, f"{args.data.root_dir}/{source}"
    if texts:
        return texts, str(args.data.root_dir)
    docs = Path(__file__).resolve().parents[2] / "docs"
    for page in sorted(docs.glob("*.md")):
        texts.append(page.read_text(errors="replace"))
        size += len(texts[-1])
        if size >= SAMPLE_CHARS:
            break
    return texts, "this repository's docs/*.md (your data is not here)"


def teacher_tokenizer_dir(args, teacher_config: Optional[Path]) -> Optional[Path]:
    """The teacher's Hugging Face tokenizer folder where it is on this machine, else None."""
    named = args.distillation.teacher_tokenizer or teacher_dir(args, teacher_config)
    folder = Path(named).expanduser() if named else None
    found = folder is not None and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return folder if found else None


def resolve_ratio(args, teacher_config: Optional[Path]) -> tuple[float, str]:
    """(the teacher's tokens per student token, how it is known) for a cross-tokenizer teacher: the value given
    (teacher_tokens_per_student_token > 0), else measured on `sample_texts` where both tokenizers are here; else
    one sentence asking for it. 1 for a student of the teacher's tokenizer."""
    given = args.teacher_tokens_per_student_token
    if not args.distillation.cross_tokenizer:
        return 1.0, "the teacher's tokenizer"
    if given > 0:
        return given, "given"
    student_path = args.data.tokenizer.path
    student_here = args.data.tokenizer.name == "bytes" or bool(student_path) and Path(student_path).exists()
    folder = teacher_tokenizer_dir(args, teacher_config)
    if not (student_here and folder is not None):
        missing = "the students' (data.tokenizer.path)" if not student_here else \
            "the teacher's (distillation.teacher_path or distillation.teacher_tokenizer, a folder with tokenizer.json)"
        raise ConfigError(f"distillation.cross_tokenizer=true: the plan needs the teacher's tokens per student token "
                          f"on your data and {missing} tokenizer is not here to measure it; pass "
                          f"teacher_tokens_per_student_token=<ratio> (python -m apps.bench.alignment_cost prints it), "
                          f"or both tokenizers.")
    from transformers import AutoTokenizer

    from lingua.tokenizer import build_tokenizer

    student = build_tokenizer(args.data.tokenizer)
    teacher = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    texts, where = sample_texts(args)
    student_tokens = sum(len(student.encode(text, add_bos=False, add_eos=False)) for text in texts)
    teacher_tokens = sum(len(teacher(text, add_special_tokens=False)["input_ids"]) for text in texts)
    ratio = teacher_tokens / max(student_tokens, 1)
    return float(f"{ratio:.3g}") if math.isfinite(ratio) and ratio > 0 else 1.0, f"measured on {where}"
