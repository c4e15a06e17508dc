"""Several teachers from their caches (`distillation.teachers`, each with a `cache_dir`): one stream of windows,
every teacher's targets for each.

    loader = open_training_caches(kd, data, attn_mask, tokenizer, batch_size, dp_rank, dp_degree)
    batch = next(loader)  # input_ids, labels, doc_ids, source_ids, teachers: [TeacherOutputs, one per teacher]

Each cache is written once from its teacher by apps.main.teacher_cache (a cross-tokenizer teacher's cache already
holds the students' ids and positions). The caches must describe the same windows: each is checked against the
students' settings (as one teacher's cache is), then against the first cache for what decides which windows a
shard holds (the layout: streams, windows per stream and per shard, the sources' order); each batch's windows are
compared as they are read. Per-source routing needs each window's data source, which caches written before the
shards stored it lack: they train one teacher, or several mixed by weight.
"""

from dataclasses import dataclass

import torch

from lingua.distillation.cache.store import PREPARE_HINT, CacheLoader, CacheManifest, checked_manifest, open_cache, \
    settings_manifest
from lingua.errors import DataError

# What decides which windows a shard of a cache holds, beyond the students' settings every cache is checked against.
LAYOUT = ("data", "tokenizer_fingerprint", "vocab_size", "attn_mask", "streams", "sequences_per_stream",
          "shard_sequences", "source_names")
WINDOW_KEYS = ("input_ids", "labels", "doc_ids", "source_ids")


def open_training_caches(kd, data, attn_mask: str, tokenizer, batch_size: int, dp_rank: int, dp_degree: int):
    """The cache(s) a student trains from: one teacher's `CacheLoader`, or several teachers' `TeacherCaches`;
    a cache written with other settings, another layout or without the sources routing needs is one sentence."""
    if not kd.teachers:
        return open_cache(kd.cache_dir, settings_manifest(kd, data, attn_mask, tokenizer), batch_size, dp_rank,
                          dp_degree)
    dirs = [teacher.cache_dir for teacher in kd.teachers]
    manifests = [checked_manifest(d, settings_manifest(kd.teacher_args(i), data, attn_mask, tokenizer),
                                  f" (distillation.teachers[{i}])") for i, d in enumerate(dirs)]
    check_same_windows(dirs, manifests)
    routes = any(teacher.sources for teacher in kd.teachers)
    if routes:
        check_sources_stored(dirs, manifests)
    return TeacherCaches([CacheLoader(d, m, batch_size, dp_rank, dp_degree) for d, m in zip(dirs, manifests)], routes)


def check_same_windows(dirs: list[str], manifests: list[CacheManifest]) -> None:
    """Every cache's layout is the first's: one sentence naming the two caches and the setting that differs (a
    cache written before source names has none: it agrees with any)."""
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


@dataclass
class TeacherCaches:
    """Several teachers' caches read in step, as one training dataset: each batch's windows once (checked to be
    the same in every cache) and `teachers`, each cache's targets for them. Resumable like one `CacheLoader`."""

    loaders: list[CacheLoader]
    routes_by_source: bool = False
    bad_lines: int = 0  # the caches hold no malformed lines: their writers' loaders skipped them

    @property
    def manifest(self) -> CacheManifest:
        return self.loaders[0].manifest

    def __iter__(self) -> "TeacherCaches":
        return self

    def __next__(self) -> dict:
        shards = [loader.shards[loader.position["shard"]].path for loader in self.loaders]  # where the batch starts
        batches = [next(loader) for loader in self.loaders]
        windows = {key: value for key, value in batches[0].items() if key != "teacher"}
        for shard, batch in zip(shards[1:], batches[1:]):
            for key in WINDOW_KEYS:
                if key in windows and key in batch and not torch.equal(windows[key], batch[key]):
                    raise DataError(f"The teacher cache shards {shards[0]} and {shard} hold different windows "
                                    f"({key} differ): the caches were written from different data files; write "
                                    f"every teacher's cache from the same data.root_dir.")
            if windows.get("source_ids") is None and "source_ids" in batch:  # an older cache beside a newer one
                windows["source_ids"] = batch["source_ids"]
        if windows.get("source_ids") is None:
            if self.routes_by_source:  # a cache resumed across the change may hold shards without them
                raise DataError(f"The teacher cache shard {shards[0]} stores no data source per window, which "
                                f"distillation.teachers[i].sources routes by; rewrite its cache into a new directory "
                                f"({PREPARE_HINT.format(dir='<new dir>')}).")
            windows.pop("source_ids", None)
        return {**windows, "teachers": [batch["teacher"] for batch in batches]}

    def state_dict(self) -> dict:
        return self.loaders[0].state_dict()  # the caches are read in step: one position

    def load_state_dict(self, state: dict) -> None:
        for loader in self.loaders:
            loader.load_state_dict(state)

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()
