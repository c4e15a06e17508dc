"""Teacher cache format v2: each shard's tensors coded for what they are, then zstd. Lossless, and about half of
v1's bytes (v1 stored the bridge's tensors as they are). Every stream is in zstd frames with checksums, one frame
per byte plane of a multi-byte stream (all first bytes, then all second bytes: each plane has its own statistics):

    tokens, doc_ids   the windows (uint16 tokens when the vocabulary fits)
    source_ids        each window's data source (its index in the manifest's source_names); absent in older shards
    id_table          the shard's distinct teacher ids, most frequent first (ties ascending, zigzag deltas; a ULD
                      cache also holds the negative ids of unmapped entries)
    id_ranks          each entry's id as its rank in id_table: frequent ids get small numbers, fewer bits after zstd
    value_first       per position, its first (most likely) entry's value as its float bit pattern
    value_gaps        each next entry's bit pattern minus the previous one's, uint8, 255 = see value_escapes: log-probs
                      (<= 0) sorted most likely first have ascending sign-less bit patterns, so no gap is negative
    value_escapes     the gaps of 255 or more, uint32
    extra             the topk tail mass or the sampled negative entropy, float32
    n_distinct, counts  sampled only: a position's k draws as its distinct ids with their counts
    kd_weight         cross-tokenizer caches only: a bit per position (1 = aligned, a KD target), packed

Entries are stored slot by slot (every position's first entry, then every second one, ...): entries of one slot
are alike. topk keeps the bridge's order and every bit; sampled keeps the multiset of draws in the canonical order
(most likely first, ties by id), which the reader also gives v1 shards, so a v1 cache and its conversion train
bit-identically; full stores the values' bit patterns. `encode_shard` decodes what it coded and compares, so a shard
that would not round-trip is a bug caught when it is written.
"""

import math
from typing import Optional

import numpy as np
import torch
import zstandard

from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import TeacherError


class CodecError(RuntimeError):
    """A bug: a shard's coding would not round-trip (raised at write time, never under `python -O` silence)."""


# zstd's level for new caches (`zstd_level` of apps.main.teacher_cache). Measured on SmolLM2's top-64 outputs (2026-11-27):
# level 1 encodes 5-10x faster than 19 (whose shards are 2.5% smaller for top-k, 3.7% for sampled), and on an H100
# level 19 held the writer to 2% of its teacher's forward. Decoding speed does not depend on the level.
ZSTD_LEVEL = 1
OLD_ZSTD_LEVEL = 19  # caches written before the level was recorded
ESCAPE = 255
FLOAT_BITS = {2: np.uint16, 4: np.uint32}  # element size -> the integer type of its bit pattern


def _compress(array: np.ndarray, planes: bool, level: int) -> tuple[torch.Tensor, dict]:
    """One stream: the array's bytes in zstd frames, one per byte plane when `planes`."""
    array = np.ascontiguousarray(array)
    planes = bool(planes and array.itemsize > 1)
    raw = array.view(np.uint8).reshape(-1, array.itemsize).T if planes else array.view(np.uint8).reshape(1, -1)
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    frames = [compressor.compress(np.ascontiguousarray(plane).tobytes()) for plane in raw]
    spec = {"dtype": array.dtype.str, "shape": list(array.shape), "planes": planes, "frames": [len(f) for f in frames]}
    return torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8), spec


def _decompress(blob: torch.Tensor, spec: dict) -> np.ndarray:
    dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
    plane_size = int(np.prod(shape)) * (1 if spec["planes"] else dtype.itemsize)
    data, offsets = blob.numpy().tobytes(), np.cumsum([0, *spec["frames"]])
    decompressor = zstandard.ZstdDecompressor()
    raw = np.stack([np.frombuffer(decompressor.decompress(data[a:b], max_output_size=plane_size), dtype=np.uint8)
                    for a, b in zip(offsets[:-1], offsets[1:])])
    if spec["planes"]:
        raw = np.ascontiguousarray(raw.T)
    return raw.view(dtype).reshape(shape)


def _float_keys(values: torch.Tensor) -> np.ndarray:
    """Sign-less bit patterns of log-probs (all <= 0): ascending as the values descend. +0.0 is key 0."""
    width = values.element_size()
    bits = values.contiguous().view(torch.int16 if width == 2 else torch.int32).numpy().view(FLOAT_BITS[width])
    sign = np.array(1 << (8 * width - 1), dtype=bits.dtype)
    if not bool((((bits & sign) != 0) | (bits == 0)).all()):
        raise CodecError("a teacher log-prob above 0: not log-probabilities")
    return (bits & ~sign).astype(np.int64)


def _keys_to_values(keys: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    width = torch.tensor([], dtype=dtype).element_size()
    kind = FLOAT_BITS[width]
    sign = np.array(1 << (8 * width - 1), dtype=kind)
    bits = np.where(keys == 0, 0, keys.astype(kind) | sign).astype(kind)
    return torch.from_numpy(bits.view(np.int16 if width == 2 else np.int32).copy()).view(dtype)


def _slot_major(run_lengths: np.ndarray) -> np.ndarray:
    """Entry indices slot by slot: every position's first entry, then every second one, ..."""
    if len(run_lengths) and (run_lengths == run_lengths[0]).all():  # top-k: a transpose
        return np.arange(int(run_lengths.sum())).reshape(len(run_lengths), -1).T.ravel()
    starts = np.cumsum(run_lengths) - run_lengths
    slot = np.arange(int(run_lengths.sum())) - np.repeat(starts, run_lengths)
    return np.argsort(slot, kind="stable")


def _code_entries(ids: np.ndarray, keys: np.ndarray, run_lengths: np.ndarray, streams: dict, specs: dict,
                  level: int) -> None:
    """A position's entries (a run of `run_lengths` in the flat arrays), keys ascending within it: the ids as ranks
    in the shard's frequency table, the keys as each run's first plus gaps, all slot-major."""
    order = _slot_major(run_lengths)
    runs = len(run_lengths)
    gaps = np.diff(keys, prepend=0)[order[runs:]]  # slot 0 is each run's first entry: its key is stored whole
    if not (gaps >= 0).all():
        raise CodecError("the teacher's values are not sorted most likely first")
    width = FLOAT_BITS[2] if keys.max(initial=0) < 2**16 else FLOAT_BITS[4]
    _put(streams, specs, level, "value_first", keys[order[:runs]].astype(width))
    _put(streams, specs, level, "value_gaps", np.minimum(gaps, ESCAPE).astype(np.uint8))
    _put(streams, specs, level, "value_escapes", gaps[gaps >= ESCAPE].astype(np.uint32))  # in the gaps' order
    distinct, counts = np.unique(ids, return_counts=True)
    table = distinct[np.argsort(-counts, kind="stable")]  # most frequent first; ties ascend by id, so deltas are small
    lowest = int(distinct.min(initial=0))  # below 0: the marked unmapped entries of a ULD cache (`uld.py`)
    rank = np.empty(int(distinct.max(initial=0)) - lowest + 1, dtype=np.int64)
    rank[table - lowest] = np.arange(len(table))
    steps = np.diff(table, prepend=0)
    _put(streams, specs, level, "id_table", np.where(steps >= 0, 2 * steps, -2 * steps - 1).astype(np.uint32))  # zigzag
    _put(streams, specs, level, "id_ranks", rank[ids[order] - lowest].astype(np.uint16 if len(table) <= 2**16 else np.uint32))


def _decode_entries(streams: dict, specs: dict, run_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, keys) of `_code_entries`, position by position."""
    steps = _get(streams, specs, "id_table").astype(np.int64)
    table = np.cumsum(np.where(steps % 2 == 0, steps // 2, -(steps + 1) // 2))
    ids_slot_major = table[_get(streams, specs, "id_ranks").astype(np.int64)]
    gaps = _get(streams, specs, "value_gaps").astype(np.int64)
    gaps[gaps == ESCAPE] = _get(streams, specs, "value_escapes")
    deltas_slot_major = np.concatenate([_get(streams, specs, "value_first").astype(np.int64), gaps])
    if len(run_lengths) and (run_lengths == run_lengths[0]).all():  # top-k: every position k entries
        shape = (int(run_lengths[0]), len(run_lengths))
        ids = ids_slot_major.reshape(shape).T.ravel()
        return ids, np.cumsum(deltas_slot_major.reshape(shape), axis=0).T.ravel()
    order = _slot_major(run_lengths)
    ids, deltas = np.empty(len(order), dtype=np.int64), np.empty(len(order), dtype=np.int64)
    ids[order], deltas[order] = ids_slot_major, deltas_slot_major
    # A running sum restarted at each position: the cumulative deltas minus what came before its first entry.
    starts = np.cumsum(run_lengths) - run_lengths
    cumulative = np.cumsum(deltas)
    return ids, cumulative - np.repeat(cumulative[starts] - deltas[starts], run_lengths)


def _put(streams: dict, specs: dict, level: int, name: str, array: np.ndarray, planes: bool = True) -> None:
    streams[name], specs[name] = _compress(array, planes, level)


def _get(streams: dict, specs: dict, name: str) -> np.ndarray:
    return _decompress(streams[name], specs[name])


def _pack_mask(kd_weight: torch.Tensor) -> np.ndarray:
    """A cross-tokenizer kd_weight (0 or 1 per position) as packed bits (lossless only for a mask: refused else)."""
    weight = kd_weight.float().numpy().ravel()
    if not bool(((weight == 0) | (weight == 1)).all()):
        raise CodecError("a kd_weight other than 0 or 1: the cache stores it as one bit per position")
    return np.packbits(weight == 1)


def canonical_sampled(outputs: TeacherOutputs) -> TeacherOutputs:
    """A sampled position's draws in the canonical order: most likely first, ties by id (the same multiset)."""
    by_id = outputs.ids.sort(dim=-1, stable=True)
    values = outputs.values.gather(-1, by_id.indices)
    by_value = values.float().sort(dim=-1, descending=True, stable=True)
    return TeacherOutputs("sampled", values.gather(-1, by_value.indices), by_id.values.gather(-1, by_value.indices),
                          outputs.extra, outputs.kd_weight)


def encode_shard(tokens: torch.Tensor, doc_ids: torch.Tensor, outputs: TeacherOutputs,
                 vocab_size: int, level: int = ZSTD_LEVEL, source_ids: Optional[torch.Tensor] = None
                 ) -> tuple[dict, dict]:
    """A shard's v2 streams ({name: uint8 tensor}) and their specs (the shard's `codec` metadata)."""
    if outputs.values.isnan().any():
        raise TeacherError("The teacher's outputs are not finite (NaN log-probs) for windows of this cache shard; "
                           "check the teacher's weights (a NaN weight) and teacher_dtype, then run the cache command "
                           "again: finished shards are kept.")
    streams, specs = {}, {"format": outputs.format, "wire_dtype": str(outputs.values.dtype).removeprefix("torch.")}
    _put(streams, specs, level, "tokens", tokens.numpy().astype(np.uint16 if vocab_size <= 2**16 else np.int32), planes=False)
    _put(streams, specs, level, "doc_ids", doc_ids.numpy().astype(np.int16 if doc_ids.shape[1] <= 2**15 else np.int32))
    if source_ids is not None:
        narrow = np.uint8 if int(source_ids.max()) < 256 else np.uint16
        _put(streams, specs, level, "source_ids", source_ids.numpy().astype(narrow), planes=False)
    if outputs.format == "full":
        values = outputs.values.contiguous()
        bits = values.view(torch.int16 if values.element_size() == 2 else torch.int32).numpy()
        _put(streams, specs, level, "values", bits)
    else:
        if outputs.format == "sampled":
            outputs = canonical_sampled(outputs)
        positions, k = outputs.ids.shape[:-1], outputs.ids.shape[-1]
        ids = outputs.ids.reshape(-1, k).numpy().astype(np.int64)
        keys = _float_keys(outputs.values.reshape(-1, k))
        specs["positions"], specs["k"] = list(positions), k
        run_lengths = np.full(len(ids), k)
        if outputs.format == "sampled":
            keep = np.ones_like(ids, dtype=bool)  # the first of each run of one id (equal ids are adjacent)
            keep[:, 1:] = ids[:, 1:] != ids[:, :-1]
            run_lengths = keep.sum(1)
            counts = np.diff(np.append(np.flatnonzero(keep.ravel()), ids.size))
            narrow = np.uint8 if k < 256 else np.uint16
            _put(streams, specs, level, "n_distinct", run_lengths.astype(narrow))
            _put(streams, specs, level, "counts", counts[_slot_major(run_lengths)].astype(narrow))
            ids, keys = ids[keep], keys[keep]
        _code_entries(ids.ravel(), keys.ravel(), run_lengths, streams, specs, level)
        _put(streams, specs, level, "extra", outputs.extra.numpy().astype(np.float32).view(np.uint32))
        if outputs.kd_weight is not None:
            _put(streams, specs, level, "kd_weight", _pack_mask(outputs.kd_weight), planes=False)
    decoded = decode_shard(streams, specs)  # the writer's check: what it stores decodes to the teacher's bits
    if len(decoded["teacher"].tensors()) != len(outputs.tensors()):
        raise CodecError("a cache shard decoded to another number of tensors than it was given")
    pairs = [(decoded["tokens"], tokens), (decoded["doc_ids"], doc_ids), *zip(decoded["teacher"].tensors(),
                                                                             outputs.tensors())]
    if source_ids is not None:
        pairs.append((decoded["source_ids"], source_ids))
    for got, want in pairs:
        want = want.to(got.dtype).contiguous()
        if got.shape != want.shape or not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            raise CodecError("a cache shard did not decode to the tensors it was given")
    return streams, specs


def decode_shard(streams: dict, specs: dict) -> dict:
    """tokens [K, S+1] int32, doc_ids [K, S], source_ids [K] int32 (when stored) and the TeacherOutputs as the
    bridge sends them."""
    windows = {"tokens": torch.from_numpy(_get(streams, specs, "tokens").astype(np.int32)),
               "doc_ids": torch.from_numpy(_get(streams, specs, "doc_ids").copy())}
    if "source_ids" in specs:
        windows["source_ids"] = torch.from_numpy(_get(streams, specs, "source_ids").astype(np.int32))
    return {**windows, "teacher": _decode_teacher(streams, specs)}


def _decode_teacher(streams: dict, specs: dict) -> TeacherOutputs:
    wire = getattr(torch, specs["wire_dtype"])
    if specs["format"] == "full":
        bits = _get(streams, specs, "values")
        return TeacherOutputs("full", torch.from_numpy(bits.copy()).view(wire))
    positions, k = tuple(specs["positions"]), specs["k"]
    if specs["format"] == "sampled":
        run_lengths = _get(streams, specs, "n_distinct").astype(np.int64)
        counts = np.empty(int(run_lengths.sum()), dtype=np.int64)
        counts[_slot_major(run_lengths)] = _get(streams, specs, "counts")
        ids, keys = (np.repeat(entries, counts) for entries in _decode_entries(streams, specs, run_lengths))
    else:
        ids, keys = _decode_entries(streams, specs, np.full(int(np.prod(positions)), k))
    extra = torch.from_numpy(_get(streams, specs, "extra").view(np.float32).copy())
    values = _keys_to_values(keys, wire).view(*positions, k)
    kd_weight = None
    if "kd_weight" in specs:  # a cross-tokenizer shard: the aligned bits
        bits = np.unpackbits(_get(streams, specs, "kd_weight"), count=int(np.prod(positions)))
        kd_weight = torch.from_numpy(bits.astype(np.float32)).view(positions)
    return TeacherOutputs(specs["format"], values, torch.from_numpy(ids.astype(np.int32)).view(*positions, k),
                          extra.view(positions), kd_weight)


# A v2 shard's bytes per token on the KD study's data (SmolLM2-135M-Instruct's 49,152 ids, Python docs, 128-token
# windows, 64 per shard; `python -m apps.bench.codec_speed`, docs/teacher_cache.md): per position (tokens, document
# ids, first value, fp32 extra, the id table's share, the file's header) and per stored entry (an id's rank; a value
# gap, and for sampled its count), with the entries a position stores (sampled: its distinct ids among k draws).
MEASURED = {"topk": {"k": 64, "entries": 64.0, "per_position": 8.14, "id_bytes": 1.4012, "value_bytes": 0.3809},
            "sampled": {"k": 64, "entries": 22.29, "per_position": 8.6, "id_bytes": 1.4381, "value_bytes": 0.8408}}
MEASURED_VOCAB = 49152


def planned_bytes_per_token(output: str, k: int, vocab_size: int, wire_bytes: int, seq_len: int,
                            version: int = 2, wire_dtype: str = "bf16") -> float:
    """Bytes per token a cache takes on disk: exact for version 1; for version 2 the study's bf16 measurement scaled
    (entries with k, an id's bytes with log2 of the vocabulary; low for sampled at small k: 15 B against 19 at k = 8).
    `full` and fp16/fp32 wires (not measured) count at the v1 size."""
    windows = 4 * (seq_len + 1) / seq_len + (2 if seq_len + 1 <= 2**15 else 4)  # int32 tokens, document ids
    v1 = windows + (vocab_size * wire_bytes if output == "full" else k * (wire_bytes + (2 if vocab_size <= 2**16 else 4)) + 4)
    if version == 1 or output == "full" or wire_dtype != "bf16":
        return v1
    measured = MEASURED[output]
    per_entry = measured["id_bytes"] * math.log2(max(vocab_size, 2)) / math.log2(MEASURED_VOCAB) + measured["value_bytes"]
    return min(v1, measured["per_position"] + measured["entries"] * k / measured["k"] * per_entry)
