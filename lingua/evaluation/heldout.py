"""Held-out batches for in-loop evaluation: the `*.val.jsonl` files of the sources, sharded like training,
tokenized and packed into windows; the last window and batch are padded (labels -100)."""

import itertools
from pathlib import Path
from typing import Iterator, Optional

import torch

from lingua.data import IGNORE_INDEX, DataArgs
from lingua.loading.documents import FileShard, MalformedLines, list_val_files, read_line, shard_files
from lingua.errors import MissingPathError
from lingua.tokenizer import Tokenizer


def _eval_documents(shards: list[FileShard], malformed: MalformedLines) -> Iterator[str]:
    for shard in shards:
        with open(shard.path, "rb") as f:
            for line_no in itertools.count():
                raw, size = read_line(f)
                if not size:
                    break
                if line_no % shard.stride == shard.offset:
                    text = malformed.text_of(raw, shard.path, line_no)
                    if text is not None:
                        yield text
        malformed.file_done(shard)


def _eval_windows(token_lists: Iterator[list[int]], length: int) -> Iterator[tuple[list[int], list[int]]]:
    tokens: list[int] = []
    doc_ids: list[int] = []
    for ids in token_lists:
        pos = 0
        while pos < len(ids):
            take = min(length - len(tokens), len(ids) - pos)
            doc_ids.extend([doc_ids[-1] + 1 if doc_ids else 0] * take)
            tokens.extend(ids[pos:pos + take])
            pos += take
            if len(tokens) == length:
                yield tokens, doc_ids
                tokens, doc_ids = [], []
    if len(tokens) > 1:  # a lone last token has nothing to predict
        yield tokens, doc_ids


def _eval_batch(windows: list[tuple[list[int], list[int]]], batch_size: int, seq_len: int,
                pad_id: int) -> dict[str, torch.Tensor]:
    """Pads a short last window / batch: padding has labels -100 and a document id of its own."""
    input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    doc_ids = torch.zeros((batch_size, seq_len), dtype=torch.int32)
    for row, (tokens, docs) in enumerate(windows):
        n_inputs = min(len(tokens), seq_len)
        input_ids[row, :n_inputs] = torch.tensor(tokens[:n_inputs])
        labels[row, :len(tokens) - 1] = torch.tensor(tokens[1:])
        doc_ids[row, :n_inputs] = torch.tensor(docs[:n_inputs], dtype=torch.int32)
        doc_ids[row, n_inputs:] = docs[n_inputs - 1] + 1
    return dict(input_ids=input_ids, labels=labels, doc_ids=doc_ids)


def eval_files(args: DataArgs) -> dict[str, list[Path]]:
    """Source -> its `*.val.jsonl` files (data.eval_sources, or every source with a positive weight that
    has some); MissingPathError when there is nothing to evaluate. Cheap: the trainer checks it at startup."""
    explicit = args.eval_sources is not None
    names = list(args.eval_sources) if explicit else [name for name, w in args.sources.items() if w > 0]
    files = {}
    for name in names:
        found = list_val_files(args.root_dir, name)
        if explicit and not found:
            raise MissingPathError(f"No '*.val.jsonl' file in {str(Path(args.root_dir) / name)!r} for eval source "
                                   f"{name!r}; add one or remove {name!r} from data.eval_sources.")
        if found:
            files[name] = found
    if not files:
        searched = ", ".join(repr(str(Path(args.root_dir) / name)) for name in names)
        raise MissingPathError(f"No validation files ('*.val.jsonl') in {searched or 'no source'}; write them with "
                               f"setup/download_prepare_hf_data.py or turn in-loop evaluation off (heldout.every=0).")
    return files


def iterate_eval_batches(args: DataArgs, tokenizer: Tokenizer, dp_rank: int, dp_degree: int,
                         max_batches: Optional[int] = None) -> Iterator[dict[str, torch.Tensor]]:
    """Finite batches over this rank's share of the `*.val.jsonl` files, sharded like training.

    Same batch dict as training; the last window and batch are padded (labels -100), and ranks may get
    different numbers of batches. Raises FileNotFoundError at once when there is nothing to evaluate.
    """
    args.validate()
    assert 0 <= dp_rank < dp_degree, (dp_rank, dp_degree)
    files = eval_files(args)
    shards = [shard for name in files for shard in shard_files(files[name], dp_rank, dp_degree)]
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    return _eval_batches(args, tokenizer, shards, pad_id, max_batches)


def _eval_batches(args: DataArgs, tokenizer: Tokenizer, shards: list[FileShard], pad_id: int,
                  max_batches: Optional[int]) -> Iterator[dict[str, torch.Tensor]]:
    malformed = MalformedLines()
    token_lists = (tokenizer.encode(text, args.add_bos, args.add_eos) for text in _eval_documents(shards, malformed))
    batch: list = []
    produced = 0
    for window in _eval_windows(token_lists, args.seq_len + 1):
        if max_batches is not None and produced >= max_batches:
            return
        batch.append(window)
        if len(batch) == args.batch_size:
            yield _eval_batch(batch, args.batch_size, args.seq_len, pad_id)
            produced, batch = produced + 1, []
    if batch and (max_batches is None or produced < max_batches):
        yield _eval_batch(batch, args.batch_size, args.seq_len, pad_id)
