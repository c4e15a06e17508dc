"""The reader: 1..N teachers' caches (one teacher is a list of one) as one training dataset.

    loader = open_training_caches(kd, data, attn_mask, tokenizer, batch_size, dp_rank, dp_degree)
    batch = next(loader)  # input_ids, labels, doc_ids, source_ids, teachers: [TeacherOutputs, one per cache]

Each cache is checked against the students' settings, then against the first cache's layout; each batch's windows
are compared as they are read. Caches written before shards stored each window's source cannot route by source.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lingua.distillation.cache.store import (PREPARE_HINT, CacheManifest, check_cache_complete, describe_differences,
                                             read_shard, settings_manifest)
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import DataError, LaunchError
from lingua.loading.documents import shard_files

logger = logging.getLogger(__name__)

# What decides which windows a shard of a cache holds, beyond the students' settings every cache is checked against.
LAYOUT = ("data", "tokenizer_fingerprint", "vocab_size", "attn_mask", "streams", "sequences_per_stream",
          "shard_sequences", "source_names")
TRAINING_SETTINGS = ("output", "k", "temperature", "wire_dtype", "attn_mask", "tokenizer_fingerprint", "vocab_size",
                     "data", "cross_tokenizer", "unmapped_entries")
WINDOW_KEYS = ("input_ids", "labels", "doc_ids", "source_ids")


def open_training_caches(kd, data, attn_mask: str, tokenizer, batch_size: int, dp_rank: int, dp_degree: int):
    """The caches a student trains from (one per teacher with a cache_dir), or None when every teacher runs online;
    a cache written with other settings, another layout or without the sources routing needs is one sentence."""
    cached = [i for i, teacher in enumerate(kd.teachers) if teacher.cache_dir]
    if not cached:
        return None
    dirs = [kd.teachers[i].cache_dir for i in cached]
    whose = ["" if kd.spelled_by_keys else f" (distillation.teachers[{i}])" for i in cached]
    manifests = [checked_manifest(d, settings_manifest(kd.teacher_args(i), data, attn_mask, tokenizer), w)
                 for i, d, w in zip(cached, dirs, whose)]
    check_same_windows(dirs, manifests)
    routes = any(teacher.sources for teacher in kd.teachers)
    if routes:
        check_sources_stored(dirs, manifests)
    return TeacherCaches(dirs, manifests, batch_size, dp_rank, dp_degree, routes)


def open_cache(cache_dir: str, wanted: CacheManifest, batch_size: int, dp_rank: int, dp_degree: int):
    """One cache, refused in one sentence when it was written with settings other than `wanted`."""
    return TeacherCaches([cache_dir], [checked_manifest(cache_dir, wanted)], batch_size, dp_rank, dp_degree)


def checked_manifest(cache_dir: str, wanted: CacheManifest, whose: str = "") -> CacheManifest:
    """The manifest in `cache_dir`, refused in one sentence (`whose`: which teacher's) when it differs from `wanted`."""
    manifest = CacheManifest.read(Path(cache_dir))
    differ = describe_differences(manifest, wanted, TRAINING_SETTINGS)
    if differ:
        raise DataError(f"The teacher cache in {cache_dir}{whose} was written with other settings: "
                        f"{'; '.join(differ)}. "
                        f"Train with the cache's settings, or write a new cache for these: "
                        f"{PREPARE_HINT.format(dir='<new dir>')}.")
    return manifest


def check_same_windows(dirs: list[str], manifests: list[CacheManifest]) -> None:
    """Every cache's layout is the first's (a cache written before source names has none: it agrees with any)."""
    for cache_dir, manifest in zip(dirs[1:], manifests[1:]):
        differ = [f"{key} is {getattr(manifest, key)} in {cache_dir} but {getattr(manifests[0], key)} in {dirs[0]}"
                  for key in LAYOUT if getattr(manifest, key) != getattr(manifests[0], key)
                  and None not in (getattr(manifest, key), getattr(manifests[0], key))]
        if differ:
            raise DataError(f"The teacher caches {dirs[0]} and {cache_dir} do not describe the same windows: "
                            f"{'; '.join(differ)}. Write each teacher's cache with the same config, streams and "
                            f"shard_sequences (`torchrun --nproc-per-node N -m apps.main.teacher_cache config=<config> "
                            f"cache_dir=<dir> distillation.teacher_path=<teacher>`).")


def check_sources_stored(dirs: list[str], manifests: list[CacheManifest]) -> None:
    """Per-source routing (a teacher's `sources`) reads each window's data source: a cache without them is refused."""
    for cache_dir, manifest in zip(dirs, manifests):
        if manifest.source_names is None:
            raise DataError(f"The teacher cache in {cache_dir} was written before caches stored each window's data "
                            f"source, which distillation.teachers[i].sources routes by; rewrite it into a new "
                            f"directory ({PREPARE_HINT.format(dir='<new dir>')}), or mix the teachers by weight alone "
                            f"(no sources).")


def joined(parts: list[dict], output: str) -> dict:
    """One cache's batch from its parts (rows of consecutive shards); a window key only when every part has it."""
    if len(parts) == 1:
        return parts[0]
    tensors = [torch.cat(ts) for ts in zip(*(p["teacher"].tensors() for p in parts))]
    teacher = TeacherOutputs.from_tensors(output, tensors)
    windows = [key for key in WINDOW_KEYS if all(key in p for p in parts)]
    return {**{key: torch.cat([p[key] for p in parts]) for key in windows}, "teacher": teacher}


@dataclass
class TeacherCaches:
    """1..N caches read in step as one rank's dataset, looping over its shards forever: batches of `batch_size`
    windows (the same in every cache) with `teachers`, each cache's targets. One layout, so one position."""

    dirs: list[str]
    manifests: list[CacheManifest]
    batch_size: int
    dp_rank: int
    dp_degree: int
    routes_by_source: bool = False
    position: dict = field(default_factory=lambda: dict(shard=0, row=0, epoch=0))
    bad_lines: int = 0  # the caches hold no malformed lines: their writers' loaders skipped them

    def __post_init__(self):
        self.shards = [shard_files(check_cache_complete(Path(d), m), self.dp_rank, self.dp_degree)
                       for d, m in zip(self.dirs, self.manifests)]
        for cache_dir, shards in zip(self.dirs, self.shards):
            logger.info(f"cache rank {self.dp_rank}/{self.dp_degree} reads {len(shards)} shard(s) of {cache_dir}"
                        + (f", 1/{shards[0].stride} of the rows" if shards[0].stride > 1 else ""))

    @property
    def manifest(self) -> CacheManifest:
        return self.manifests[0]

    def __iter__(self) -> "TeacherCaches":
        return self

    def _rows_of(self, shard) -> list[int]:
        return list(range(shard.offset, self.manifest.shard_sequences, shard.stride))

    def __next__(self) -> dict:
        starts = [shards[self.position["shard"]].path for shards in self.shards]  # where the batch starts
        parts, needed = [], self.batch_size  # parts: per shard read, each cache's rows of it
        while needed:
            index = self.position["shard"]
            shard = self.shards[0][index]
            rows = self._rows_of(shard)[self.position["row"]:self.position["row"] + needed]
            if rows:
                span = range(rows[0], rows[-1] + 1, shard.stride)
                parts.append([read_shard(Path(shards[index].path), span, manifest)
                              for shards, manifest in zip(self.shards, self.manifests)])
                self.position["row"] += len(rows)
                needed -= len(rows)
            if self.position["row"] >= len(self._rows_of(shard)):
                self.position["row"] = 0
                self.position["shard"] += 1
                if self.position["shard"] == len(self.shards[0]):
                    self.position["shard"], self.position["epoch"] = 0, self.position["epoch"] + 1
                    logger.info(f"teacher cache: starting epoch {self.position['epoch']}")
        batches = [joined(list(cache_parts), m.output) for cache_parts, m in zip(zip(*parts), self.manifests)]
        windows = {key: value for key, value in batches[0].items() if key != "teacher"}
        for start, batch in zip(starts[1:], batches[1:]):
            for key in WINDOW_KEYS:
                if key in windows and key in batch and not torch.equal(windows[key], batch[key]):
                    raise DataError(f"The teacher cache shards {starts[0]} and {start} hold different windows "
                                    f"({key} differ): the caches were written from different data files; write "
                                    f"every teacher's cache from the same data.root_dir.")
            if windows.get("source_ids") is None and "source_ids" in batch:  # an older cache beside a newer one
                windows["source_ids"] = batch["source_ids"]
        if windows.get("source_ids") is None:
            if self.routes_by_source:  # a cache resumed across the change may hold shards without them
                raise DataError(f"The teacher cache shard {starts[0]} stores no data source per window, which "
                                f"distillation.teachers[i].sources routes by; rewrite its cache into a new directory "
                                f"({PREPARE_HINT.format(dir='<new dir>')}).")
            windows.pop("source_ids", None)
        return {**windows, "teachers": [batch["teacher"] for batch in batches]}

    def state_dict(self) -> dict:
        return dict(kind="teacher_cache", dp_rank=self.dp_rank, dp_degree=self.dp_degree, bad_lines=0,
                    **self.position)

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "teacher_cache":
            raise DataError("The checkpoint's data state is a jsonl stream, not a teacher cache position; resume "
                            "with the data source it was trained on (distillation.source).")
        if (state["dp_rank"], state["dp_degree"]) != (self.dp_rank, self.dp_degree):
            raise LaunchError(f"The cache position was saved by data-parallel rank {state['dp_rank']} of "
                              f"{state['dp_degree']} but this is rank {self.dp_rank} of {self.dp_degree}; resume with "
                              f"the same number of training ranks.")
        self.position = {key: state[key] for key in ("shard", "row", "epoch")}

    def close(self) -> None:
        pass
