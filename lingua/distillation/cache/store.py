"""The offline teacher cache's format: training windows with the teacher's sparse outputs, written once, read as the
dataset. A cache directory (written by `apps.main.teacher_cache`):

    cache.json                        the manifest (`CacheManifest`): what the cache was written with
    shards/shard_<i:05d>.safetensors  `shard_sequences` windows of one stream: tokens [K, S+1], doc_ids [K, S],
                                      source_ids [K] (by the manifest's source_names; absent in older caches) and
                                      the teacher's outputs, coded losslessly by codec.py (v1 stored the bridge's
                                      tensors as they are); its metadata names its stream and chunk, the loader state
                                      after it (resuming a cache) and the codec's stream specs
    index.json                        written last, when every shard is on disk: the cache is complete

Streams: a cache written for `streams=M` holds the window streams of M data-parallel students (stream d is what
`DataLoader(dp_rank=d, dp_degree=M)` yields); shard i is chunk i // M of stream i % M. Trained from with M students
(round-robin shards, `shard_files`), student d reads exactly stream d, so a run from the cache trains on the
sequences an online run with M students would; any other number of students reads every shard, in another order.
"""

import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save

from lingua.loading.stream import active_sources
from lingua.distillation.cache.codec import OLD_ZSTD_LEVEL, ZSTD_LEVEL, canonical_sampled, decode_shard, encode_shard
from lingua.distillation.distiller import tokenizer_fingerprint, tokenizer_vocab
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.teacher.model import safetensors_problem
from lingua.errors import DataError, MissingPathError

CACHE_VERSION = 2  # what the writer writes; 1 (the bridge's tensors as they are) is still read
READABLE_VERSIONS = (1, 2)
MANIFEST, INDEX, SHARDS = "cache.json", "index.json", "shards"
PREPARE_HINT = "write it with `torchrun --nproc-per-node N -m apps.main.teacher_cache config=<config> cache_dir={dir}`"
CONVERT_HINT = "convert it with `python -m apps.main.convert_cache {src} <new dir>`"
V1_NAMES = {"full": ("values",), "topk": ("values", "ids", "extra"), "sampled": ("values", "ids", "extra")}
CROSS_FIELDS = ("cross_tokenizer", "teacher_tokenizer_fingerprint", "vocab_map_fingerprint", "unmapped_entries")
# What a differing setting means, where its name alone does not say.
SETTING_NOTES = {"tokenizer_fingerprint": " (the students' tokenizer, data.tokenizer: the targets are in its ids)",
                 "cross_tokenizer": " (distillation.cross_tokenizer)",
                 "unmapped_entries": " (the teacher's unmapped entries that ULD reads: distillation.uld_weight > 0)"}


@dataclass
class CacheManifest:
    """What a cache was written with; training compares its own settings against these."""

    teacher_path: str
    tokenizer_fingerprint: int
    vocab_size: int  # the students' vocab (teacher ids beyond it are cut, as on the bridge)
    output: str
    k: int
    temperature: float
    wire_dtype: str
    attn_mask: str  # "doc_causal": the teacher attended within documents
    data: dict  # sources, seq_len, add_bos, add_eos, seed, tokenizer (not root_dir: data may move)
    streams: int
    sequences_per_stream: int
    shard_sequences: int
    teacher_heldout_ce: Optional[float] = None  # the teacher's own CE on the held-out split (a reference line)
    teacher_heldout_bpb: Optional[float] = None  # the same in bits per byte (None in caches written before it)
    version: int = CACHE_VERSION
    zstd_level: int = ZSTD_LEVEL  # the v2 streams' compression (read as OLD_ZSTD_LEVEL where a manifest lacks it)
    # distillation.cross_tokenizer (the targets in the student's ids and positions, a kd_weight bit per position):
    # written only then (CROSS_FIELDS), so a same-tokenizer manifest keeps its fields and bytes.
    cross_tokenizer: bool = False
    teacher_tokenizer_fingerprint: Optional[int] = None
    vocab_map_fingerprint: Optional[str] = None
    unmapped_entries: bool = False  # written with distillation.uld_weight > 0: the shards carry them, marked (uld.py)
    # The data sources a shard's source_ids index, in order; None: a cache written before shards stored them.
    source_names: Optional[list[str]] = None

    @property
    def n_shards(self) -> int:
        return self.streams * (self.sequences_per_stream // self.shard_sequences)

    @property
    def ids_dtype(self) -> torch.dtype:
        return torch.uint16 if self.vocab_size <= 2**16 else torch.int32

    def write(self, cache_dir: Path) -> None:
        values = asdict(self)
        if not self.cross_tokenizer:
            values = {key: value for key, value in values.items() if key not in CROSS_FIELDS}
        write_json_atomic(Path(cache_dir) / MANIFEST, values)

    @classmethod
    def read(cls, cache_dir: Path) -> "CacheManifest":
        path = Path(cache_dir) / MANIFEST
        if not path.is_file():
            raise MissingPathError(f"distillation.cache_dir={cache_dir} holds no teacher cache ({MANIFEST} is "
                                   f"missing); {PREPARE_HINT.format(dir=cache_dir)}.")
        try:
            values = json.loads(path.read_text())
            manifest = cls(**{"zstd_level": OLD_ZSTD_LEVEL, **values})
        except (json.JSONDecodeError, TypeError) as err:
            raise DataError(f"{path} is not a teacher cache manifest this code can read ({err}); "
                            f"{PREPARE_HINT.format(dir=cache_dir)} into a new directory.") from None
        if manifest.version not in READABLE_VERSIONS:
            raise DataError(f"{path} is a version {manifest.version} cache, this code reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}; {PREPARE_HINT.format(dir=cache_dir)} into a "
                            f"new directory.")
        return manifest


def data_identity(data_args) -> dict:
    """The data settings that decide a cache's windows (not root_dir or the tokenizer's path: files may move)."""
    return {"sources": dict(data_args.sources), "seq_len": data_args.seq_len, "add_bos": data_args.add_bos,
            "add_eos": data_args.add_eos, "seed": data_args.seed}


def settings_manifest(kd_args, data_args, attn_mask: str, tokenizer, **layout) -> CacheManifest:
    """The manifest these settings would write (`layout`: streams, sequences_per_stream, shard_sequences)."""
    layout = {"streams": 1, "sequences_per_stream": 0, "shard_sequences": 1, **layout}
    return CacheManifest(teacher_path=str(kd_args.teacher_path), vocab_size=tokenizer.n_words,
                         tokenizer_fingerprint=tokenizer_fingerprint(tokenizer_vocab(tokenizer)), output=kd_args.output,
                         k=kd_args.k, temperature=kd_args.temperature, wire_dtype=kd_args.wire_dtype,
                         attn_mask=attn_mask, data=data_identity(data_args), cross_tokenizer=kd_args.cross_tokenizer,
                         unmapped_entries=kd_args.cross_tokenizer and kd_args.uld_weight > 0,
                         source_names=active_sources(data_args.sources), **layout)


def describe_differences(cache: CacheManifest, wanted: CacheManifest, keys: tuple[str, ...]) -> list[str]:
    """'<key> is <cache value> in the cache but <wanted value> here' for each key that differs."""
    out = []
    for key in keys:
        have, want = getattr(cache, key), getattr(wanted, key)
        if key == "k" and cache.output == wanted.output == "full":
            continue  # full sends no ids
        if have != want:
            out.append(f"{key} is {have} in the cache but {want} here{SETTING_NOTES.get(key, '')}")
    return out


def write_json_atomic(path: Path, obj) -> None:
    write_file_atomic(path, json.dumps(obj, indent=1).encode())


def shard_path(cache_dir: Path, index: int) -> Path:
    return Path(cache_dir) / SHARDS / f"shard_{index:05d}.safetensors"


def write_shard(path: Path, tokens: torch.Tensor, doc_ids: torch.Tensor, outputs: TeacherOutputs,
                manifest: CacheManifest, metadata: dict, source_ids: Optional[torch.Tensor] = None) -> None:
    """One shard, atomically (`write_file_atomic`)."""
    write_file_atomic(path, shard_bytes(tokens, doc_ids, outputs, manifest, metadata, source_ids))


def shard_bytes(tokens: torch.Tensor, doc_ids: torch.Tensor, outputs: TeacherOutputs, manifest: CacheManifest,
                metadata: dict, source_ids: Optional[torch.Tensor] = None) -> bytes:
    """A shard file's bytes: coded by codec.py (version 2), or the bridge's tensors as they are (version 1)."""
    if manifest.version == 1:
        names = V1_NAMES[outputs.format]
        tensors = {"tokens": tokens.to(torch.int32).contiguous(),
                   "doc_ids": doc_ids.to(torch.int16 if tokens.shape[1] <= 2**15 else torch.int32).contiguous()}
        for name, tensor in zip(names, outputs.tensors()):
            tensors[name] = (tensor.to(manifest.ids_dtype) if name == "ids" else tensor).contiguous()
    else:
        tensors, codec = encode_shard(tokens, doc_ids, outputs, manifest.vocab_size, manifest.zstd_level, source_ids)
        metadata = {**metadata, "codec": codec}
    return canonical_safetensors(save(tensors, metadata={key: json.dumps(value) for key, value in metadata.items()}))


def write_file_atomic(path: Path, data: bytes) -> None:
    """`data` to `path` through `.tmp`, synced, renamed (a crash leaves no half file under the name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def canonical_safetensors(data: bytes) -> bytes:
    """A safetensors file's bytes with its metadata keys sorted (the library's order changes from process to process;
    a shard must be the same bytes whoever writes it). Same header length, so the tensors' offsets hold."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= size, (len(text), size)  # the same entries, reordered: never longer
    return data[:8] + text.ljust(size, b" ") + data[8 + size:]


def shard_metadata(path: Path) -> Optional[dict]:
    """A complete shard's metadata, or None if the file is missing, truncated or not a shard."""
    if not path.is_file() or safetensors_problem(path) is not None:
        return None
    try:
        with safe_open(str(path), "pt") as f:
            return {key: json.loads(value) for key, value in (f.metadata() or {}).items()}
    except Exception:  # any unreadable header means: write it again
        return None


def read_shard(path: Path, rows: range, manifest: CacheManifest) -> dict:
    """Rows of a shard as a training batch: input_ids, labels, doc_ids, source_ids (when stored) and the teacher's
    outputs (sampled draws in the codec's canonical order whatever the version: a v1 cache trains as its conversion)."""
    span = slice(rows.start, rows.stop, rows.step)
    sources = {}
    if manifest.version == 1:
        tokens, doc_ids, teacher = read_v1_shard(path, span, manifest)
        if manifest.output == "sampled":  # v2 stores this order
            teacher = canonical_sampled(teacher)
    else:
        shard = _decoded_shard(str(path), *_file_identity(path))
        teacher = TeacherOutputs.from_tensors(manifest.output, [t[span] for t in shard["teacher"].tensors()])
        tokens, doc_ids = shard["tokens"][span].long(), shard["doc_ids"][span].int()
        if "source_ids" in shard:
            sources["source_ids"] = shard["source_ids"][span]
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "doc_ids": doc_ids,
            **sources, "teacher": teacher}


def read_v1_shard(path: Path, span: slice, manifest: CacheManifest) -> tuple:
    contiguous = slice(span.start, span.stop)  # read the contiguous span, then keep every step-th row

    def rows_of(f, name):
        return f.get_slice(name)[contiguous][:: span.step]
    with safe_open(str(path), "pt") as f:
        tokens = rows_of(f, "tokens").long()
        doc_ids = rows_of(f, "doc_ids").int()
        tensors = [rows_of(f, name) for name in V1_NAMES[manifest.output]]
    if manifest.output != "full":
        tensors[1] = tensors[1].to(torch.int32)
    return tokens, doc_ids, TeacherOutputs.from_tensors(manifest.output, tensors)


def forget_decoded_shards() -> None:
    """Drop the memo of the last decoded shards: their memory is freed (a reader done with a cache in a process that
    goes on) and the next read decodes again (what the benchmarks time)."""
    _decoded_shard.cache_clear()


def _file_identity(path: Path) -> tuple[int, int, int]:
    stat = os.stat(path)  # a rewritten shard is a new file (os.replace): a new inode, whatever the mtime's grain
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=2)  # a loader reads a shard's rows batch by batch: decode it once
def _decoded_shard(path: str, inode: int, mtime_ns: int, size: int) -> dict:
    try:
        with safe_open(path, "pt") as f:
            codec = json.loads((f.metadata() or {})["codec"])
            streams = {name: f.get_tensor(name) for name in f.keys()}
        return decode_shard(streams, codec)
    except Exception as err:  # no codec metadata, a zstd checksum, a stream that does not decode: damaged
        raise DataError(f"Teacher cache shard {path} is damaged ({type(err).__name__}: {err}); delete it and run "
                        f"the cache command again to rewrite it.") from None


def check_cache_complete(cache_dir: Path, manifest: CacheManifest) -> list[Path]:
    """Every shard of a finished cache, checked cheaply (file sizes against headers); one sentence otherwise."""
    cache_dir = Path(cache_dir)
    if not (cache_dir / INDEX).is_file():
        raise MissingPathError(f"The teacher cache in {cache_dir} is not finished ({INDEX} is missing); run the cache "
                               f"command again to complete it: {PREPARE_HINT.format(dir=cache_dir)}.")
    paths = [shard_path(cache_dir, i) for i in range(manifest.n_shards)]
    for path in paths:
        if not path.is_file():
            raise MissingPathError(f"Teacher cache shard {path} is missing; run the cache command again to write it: "
                                   f"{PREPARE_HINT.format(dir=cache_dir)}.")
        problem = safetensors_problem(path)
        if problem is not None:
            raise DataError(f"Teacher cache shard {path} is damaged ({problem}); delete it and run the cache command "
                            f"again to rewrite it: {PREPARE_HINT.format(dir=cache_dir)}.")
    return paths
