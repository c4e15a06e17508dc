"""Write the offline teacher cache: the training windows and the teacher's sparse outputs, once.

    torchrun --nproc-per-node N -m apps.main.teacher_cache config=<a distillation config> cache_dir=DIR [streams=M]
    torchrun --nproc-per-node M -m apps.main.train config=<the same config> distillation.source=cache \
        distillation.cache_dir=DIR

Every rank is a teacher: it loads the teacher, tokenizes and packs the data exactly as training does
(`DataLoader`, stream d = what data-parallel student d of `streams` would read) and writes the shards
assigned to it (shard i is chunk i // M of stream i % M; rank r writes shards r, r+N, ...). With
distillation.teacher_tp=T the N ranks form N / T replicas of T consecutive ranks (on one node), each
holding the teacher sharded tensor-parallel: replica j writes shards j, j + N/T, ..., its first rank
writing the files, every rank of it running the forward. A rank reads its next windows ahead on a thread
and hands finished shards to `encode_workers` processes that encode and write them while its teacher runs the
next forward (lingua/distillation/cache/writer.py; 0 = the serial writer, the same bytes). Shards are
written atomically, so a rerun skips the finished ones and resumes the others from the loader state
saved in the last finished shard of their stream. With distillation.cross_tokenizer=true the teacher keeps its
own tokenizer: each window is aligned on the read-ahead thread as an online teacher rank aligns it
(CrossTokenizerTeacher), and the shards hold the student-side targets (the students' ids and positions, a
kd_weight bit per position), so the cache trains any run of that student tokenizer. The teacher's held-out
CE (the students' reference line; not with another tokenizer) is computed last, its batches split over the
replicas. `cache.json` records the settings: training refuses a cache whose settings differ from its own.
`index.json`, written last, marks the cache complete. Then a sweep over alpha, temperature or student size
pays the teacher once (see lingua/distillation/cache/store.py).
"""

if __name__ == "__main__":  # first, before the slow imports: see lingua.cli.entry.hold_sigterm
    from lingua.cli.entry import hold_sigterm

    hold_sigterm()

import logging
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from apps.main.train import TrainArgs
from lingua.args import parse_args, require, require_filled
from lingua.evaluation.bits_per_byte import batches_target_bytes, bits_per_byte, token_byte_lengths
from lingua.cli.entry import release_sigterm, run_cli
from lingua.data import DataLoader
from lingua.distillation.args import WIRE_DTYPES
from lingua.distillation.online.bridge import tokenizer_fingerprint
from lingua.distillation.cache.store import (
    CONVERT_HINT,
    CROSS_FIELDS,
    INDEX,
    CacheManifest,
    describe_differences,
    settings_manifest,
    shard_location,
    shard_metadata,
    shard_path,
    write_json_atomic,
)
from lingua.distillation.cache.codec import ZSTD_LEVEL
from lingua.distillation.cache.writer import READ_AHEAD, ShardWriters, StageClock, WindowReadAhead, auto_encode_workers
from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher, load_cross_tokenizer
from lingua.distillation.distiller import tokenizer_vocab
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.teacher.model import TeacherModel
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.errors import ConfigError, DataError
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.logger import init_logger
from lingua.metrics import format_duration
from lingua.parallel.collectives import agree_flags, log_collective
from lingua.parallel.launch_plan import LaunchPlan, read_launch_env, tensor_parallel_replicas
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger("teacher_cache")
PROGRESS_EVERY_S = 10.0


@dataclass
class TeacherCacheArgs(TrainArgs):
    cache_dir: str = ""  # the folder to write the cache to (created; a rerun resumes it); required
    streams: int = 1  # data-parallel students the cache is laid out for (train from it with as many)
    sequences_per_stream: int = 0  # windows per stream; 0 = what the config trains on: steps x grad_acc x batch
    shard_sequences: int = 64  # windows per shard file (the unit of resuming)
    forward_rows: int = 8  # windows per teacher forward
    # Processes encoding and writing shards while the teacher runs (lingua/distillation/cache/writer.py); -1: one
    # per core the writer's main thread leaves free; 0: the serial writer (read, forward, encode, write in turn)
    encode_workers: int = -1
    # zstd's level for the shards: 1 (fast: a GPU teacher outruns level 19 many times over) to 19 (2.5-4% smaller
    # shards, 5-10x the encoding time); a cache keeps the level it was started with. Reading speed is the same.
    zstd_level: int = ZSTD_LEVEL

    def validate(self, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> None:
        """The trainer's pass for the config with an online teacher (whatever distillation.source says: this
        job is the teacher), then the cache's own keys. Every rank is a teacher here, so the launch is planned
        without teacher ranks, then cut into replicas of distillation.teacher_tp ranks."""
        require(not self.distillation.teachers, "distillation.teachers", [t.path for t in self.distillation.teachers],
                "the cache writer runs one teacher: write each teacher's cache with its distillation.teacher_path")
        teacher = replace(self.distillation, source="online", n_teacher_ranks=self.distillation.teacher_tp)
        TrainArgs.validate(replace(self, enable_distillation=True, distillation=teacher))
        require(bool(self.cache_dir), "cache_dir", self.cache_dir, "pass cache_dir=<folder for the teacher cache>")
        require_filled("cache_dir", self.cache_dir, "the folder to write the teacher cache to")
        for key in ("streams", "shard_sequences", "forward_rows"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use a positive integer")
        require(type(self.zstd_level) is int and 1 <= self.zstd_level <= 22, "zstd_level", self.zstd_level,
                "use a zstd level from 1 (fastest) to 22 (smallest); 19 suits a CPU teacher, 1 a GPU one")
        require(self.encode_workers >= -1, "encode_workers", self.encode_workers,
                "use -1 (one per free core), 0 (the serial writer) or a number of worker processes")
        require(self.sequences_per_stream >= 0, "sequences_per_stream", self.sequences_per_stream,
                "use 0 (the config's steps x grad_acc_steps x data.batch_size) or a positive number of windows")
        if world_size is not None:
            LaunchPlan.for_launch(self.distributed, 0, world_size, local_world_size or world_size)
            tp = self.distillation.teacher_tp
            require(world_size % tp == 0, "distillation.teacher_tp", tp,
                    f"the cache writer's {world_size} ranks form replicas of teacher_tp ranks; "
                    f"launch a multiple of {tp}")
            tensor_parallel_replicas(list(range(world_size)), tp, local_world_size or world_size)


def planned_manifest(args: TeacherCacheArgs, tokenizer, cross: Optional[CrossTokenizerTeacher] = None) -> CacheManifest:
    """The manifest this writer writes; a cross-tokenizer one also records the teacher's tokenizer and the map."""
    wanted = args.sequences_per_stream or args.steps * args.grad_acc_steps * args.data.batch_size
    per_stream = -(-wanted // args.shard_sequences) * args.shard_sequences  # whole shards
    manifest = settings_manifest(args.distillation, args.data, args.model.attn_mask, tokenizer, streams=args.streams,
                                 sequences_per_stream=per_stream, shard_sequences=args.shard_sequences,
                                 zstd_level=args.zstd_level)
    if cross is not None:
        manifest.teacher_tokenizer_fingerprint = cross.teacher_fingerprint
        manifest.vocab_map_fingerprint = cross.vocab_map.fingerprint()
    return manifest


def check_tokenizers(tokenizer, teacher: TeacherModel, teacher_path: str) -> None:
    """The students' tokenizer must be the teacher's, as at the online handshake."""
    student = tokenizer_fingerprint(tokenizer_vocab(tokenizer))
    if student != tokenizer_fingerprint(teacher.tokenizer.get_vocab()) or tokenizer.n_words > teacher.vocab_size:
        raise ConfigError(f"The data tokenizer (vocab {tokenizer.n_words}) does not match the teacher's (vocab "
                          f"{teacher.vocab_size}) at {teacher_path}. Students must use the teacher's tokenizer: set "
                          f"data.tokenizer.name=hf data.tokenizer.path={teacher_path}, or keep yours and set "
                          f"distillation.cross_tokenizer=true.")


def settle_manifest(cache_dir: Path, planned: CacheManifest) -> None:
    """Every rank reads the same manifest, so all agree: a cache started with other settings is refused. One
    started by an older writer is finished in its own format version (convert it afterwards: convert_cache)."""
    if not (cache_dir / "cache.json").is_file():
        return
    existing = CacheManifest.read(cache_dir)
    if existing.version != planned.version:
        logger.warning(f"{cache_dir} was started as a version {existing.version} cache: finishing it in that format; "
                       f"{CONVERT_HINT.format(src=cache_dir)} once it is complete.")
        planned.version = existing.version
    if existing.zstd_level != planned.zstd_level:  # the bytes differ, not what they decode to: one level per cache
        logger.warning(f"{cache_dir} was started at zstd_level={existing.zstd_level}: finishing it at that level.")
        planned.zstd_level = existing.zstd_level
    if existing.source_names is None:  # started before shards stored sources: the cache still has none
        planned.source_names = None
    # source_names in order: a shard's source ids index it (and `data` compares the sources as a dict, unordered)
    differ = describe_differences(existing, planned, ("teacher_path", "tokenizer_fingerprint", "vocab_size", "output",
                                                      "k", "temperature", "wire_dtype", "attn_mask", "data", "streams",
                                                      "sequences_per_stream", "shard_sequences", "source_names",
                                                      *CROSS_FIELDS))
    if differ:
        raise DataError(f"{cache_dir} already holds a teacher cache written with other settings: {'; '.join(differ)}. "
                        f"Use another cache_dir, or the settings it was started with to finish it.")


class StreamReader:
    """The window streams, each positioned where a shard needs it (resuming from a finished shard's loader state)."""

    def __init__(self, args: TeacherCacheArgs, tokenizer, cache_dir: Path, manifest: CacheManifest):
        self.args, self.tokenizer, self.cache_dir, self.manifest = args, tokenizer, cache_dir, manifest
        self.loaders: dict[int, DataLoader] = {}
        self.next_chunk: dict[int, int] = {}

    def chunk(self, stream: int, chunk: int) -> dict:
        """The windows of chunk `chunk` of `stream` (a batch of shard_sequences windows)."""
        if stream not in self.loaders or self.next_chunk[stream] > chunk:
            data = replace(self.args.data, batch_size=self.manifest.shard_sequences, load_async=False)
            self.loaders[stream] = DataLoader(data, self.tokenizer, stream, self.manifest.streams)
            self.next_chunk[stream] = 0
        loader = self.loaders[stream]
        # Start from the newest finished shard of this stream before `chunk`, instead of re-reading the files.
        for earlier in range(chunk - 1, self.next_chunk[stream] - 1, -1):
            metadata = shard_metadata(shard_path(self.cache_dir, earlier * self.manifest.streams + stream))
            if metadata is not None:
                loader.load_state_dict(metadata["loader_state"])
                self.next_chunk[stream] = earlier + 1
                break
        while self.next_chunk[stream] < chunk:
            next(loader)
            self.next_chunk[stream] += 1
        self.next_chunk[stream] += 1
        return next(loader)

    def shard_windows(self, index: int) -> tuple[int, int, dict, dict]:
        """(stream, chunk, windows, the stream's loader state after them) of shard `index`."""
        stream, chunk = shard_location(index, self.manifest.streams)
        batch = self.chunk(stream, chunk)
        return stream, chunk, batch, self.loaders[stream].state_dict()


def align_windows(cross: CrossTokenizerTeacher, batch: dict, manifest: CacheManifest, forward_rows: int) -> dict:
    """distillation.cross_tokenizer: a chunk's windows with each forward's rows aligned to the teacher's tokens
    (`aligned`, a TeacherBatch per forward of `forward_rows` windows), as an online teacher rank aligns them."""
    doc_causal = manifest.attn_mask == "doc_causal"
    aligned = [cross.teacher_batch(batch["input_ids"][start:start + forward_rows],
                                   batch["doc_ids"][start:start + forward_rows] if doc_causal else None,
                                   batch["labels"][start:start + forward_rows, -1])
               for start in range(0, batch["input_ids"].shape[0], forward_rows)]
    return {**batch, "aligned": aligned}


def cross_outputs(teacher: TeacherModel, cross: CrossTokenizerTeacher, aligned, manifest: CacheManifest,
                  generator) -> TeacherOutputs:
    """The teacher's forward on its own tokens, its top-k or draws mapped to the student's positions and ids with
    kd_weight (`CrossTokenizerTeacher.student_targets`): what `TeacherServer._cross_forward_rows` sends a student."""
    doc_ids = aligned.doc_ids.to(teacher.device) if manifest.attn_mask == "doc_causal" else None
    hidden = teacher.hidden_states(aligned.tokens.to(teacher.device), doc_ids)
    return cross.student_targets(teacher, hidden, aligned, manifest.output, manifest.k,
                                 WIRE_DTYPES[manifest.wire_dtype], generator, manifest.unmapped_entries)


def teacher_outputs(teacher: TeacherModel, batch: dict, manifest: CacheManifest, forward_rows: int,
                    generator, cross: Optional[CrossTokenizerTeacher] = None) -> Optional[TeacherOutputs]:
    """The teacher's outputs for a chunk's windows, `forward_rows` windows per forward (tensor-parallel: on the
    replica's first rank, None on the others; cross-tokenizer: from the windows `align_windows` aligned)."""
    parts = []
    for index, start in enumerate(range(0, batch["input_ids"].shape[0], forward_rows)):
        if cross is not None:
            parts.append(cross_outputs(teacher, cross, batch["aligned"][index], manifest, generator))
            continue
        rows = slice(start, start + forward_rows)
        doc_ids = batch["doc_ids"][rows].to(teacher.device) if manifest.attn_mask == "doc_causal" else None
        hidden = teacher.hidden_states(batch["input_ids"][rows].to(teacher.device), doc_ids)
        parts.append(teacher.sparse_outputs(hidden, manifest.output, manifest.k, WIRE_DTYPES[manifest.wire_dtype],
                                            manifest.vocab_size, generator))
    if parts[0] is None:
        return None
    return TeacherOutputs.from_tensors(manifest.output, [torch.cat(ts).cpu() for ts in zip(*(p.tensors() for p in parts))])


def heldout_reference(args: TeacherCacheArgs, tokenizer, teacher: TeacherModel, manifest: CacheManifest, topo,
                      replica: int, replicas: int, writer: bool) -> tuple[Optional[float], Optional[float]]:
    """The teacher's CE and bits per byte on the held-out windows the students evaluate on (each stream's share),
    or (None, None) (no held-out files). The batches are split over the replicas, each computing its share (every rank of a
    replica: the sharded forward needs them all), and the sums are all-reduced over the job: no rank waits
    idle in a collective while another computes them all."""
    try:
        batches = [b for d in range(manifest.streams) for b in iterate_eval_batches(
            args.data, tokenizer, d, manifest.streams, args.heldout.max_batches)]
    except FileNotFoundError:
        batches = None
    # Whether to compute at all decides the collectives below: every rank agrees first.
    if agree_flags({"missing": batches is None}, dist.group.WORLD, topo.device)["missing"]:
        return None, None
    share = batches[replica::replicas]
    loss_sum, tokens = teacher.heldout_ce(share, manifest.vocab_size, manifest.attn_mask == "doc_causal")
    # One rank per replica counts its share (the others of a tensor-parallel replica hold the same numbers).
    totals = torch.tensor([loss_sum, tokens] if writer else [0.0, 0.0], dtype=torch.float64, device=topo.device)
    if topo.distributed:
        log_collective("all_reduce held-out CE", dist.group.WORLD, totals)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    loss_sum, tokens = totals.tolist()
    bpb = bits_per_byte(loss_sum, batches_target_bytes(batches, token_byte_lengths(tokenizer)))  # every rank has all
    logger.info(f"cache rank {topo.global_rank}: held-out CE over {len(share)} of {len(batches)} batch(es) here "
                f"(replica {replica} of {replicas}); {loss_sum / max(tokens, 1):.4f} over {int(tokens):,} tokens in all, "
                f"{bpb:.4f} bits per byte")
    return loss_sum / max(tokens, 1), bpb


def check_k_fits_vocab(args: TeacherCacheArgs, tokenizer) -> None:
    """Top-k ids come from the data tokenizer's vocabulary (the students'; the teacher's is no smaller): k beyond
    it is refused before the teacher loads or anything is written, as the online handshake refuses it."""
    k, vocab = args.distillation.k, tokenizer.n_words
    if args.distillation.output == "topk" and k > vocab:
        raise ConfigError(f"distillation.k={k} is more than the {vocab} token ids the top-k is taken from (the data "
                          f"tokenizer's vocabulary, which the students train on); set distillation.k <= {vocab}.")


def replica_group(topo, teacher_tp: int, timeout_s: float):
    """This rank's tensor-parallel group: replicas of teacher_tp consecutive ranks, one group each, made by every
    rank in the same order (new_group is collective); None with teacher_tp=1."""
    if teacher_tp == 1:
        return None
    mine = None
    for i, ranks in enumerate(tensor_parallel_replicas(list(range(topo.world_size)), teacher_tp,
                                                       topo.local_world_size)):
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), group_desc=f"teacher_tp_{i}")
        if topo.global_rank in ranks:
            mine = group
            topo.group_names[id(group)] = f"teacher_tp_{i}"
    return mine


def shards_to_write(cache_dir: Path, mine: list[int], tp_group, device) -> list[int]:
    """The shards of `mine` not written yet, as the replica's first rank sees them on disk (shared with the
    other ranks of its replica, which then run the same forwards)."""
    todo = [i for i in mine if shard_metadata(shard_path(cache_dir, i)) is None]
    if tp_group is None:
        return todo
    padded = torch.full((len(mine),), -1, dtype=torch.int64, device=device)
    padded[:len(todo)] = torch.tensor(todo, dtype=torch.int64)
    log_collective("broadcast shards to write", tp_group, padded)
    dist.broadcast(padded, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return [i for i in padded.tolist() if i >= 0]


def write_cache(args: TeacherCacheArgs, topo) -> None:
    cache_dir = Path(args.cache_dir)
    tokenizer = build_tokenizer(args.data.tokenizer)
    check_k_fits_vocab(args, tokenizer)
    tp = args.distillation.teacher_tp
    tp_group = replica_group(topo, tp, args.distributed.init_timeout_s)
    teacher = TeacherModel(args.distillation, topo.device, tp_group)
    cross = None
    if args.distillation.cross_tokenizer:  # the teacher keeps its tokenizer; the shards hold student-side targets
        cross = load_cross_tokenizer(args.data.tokenizer, args.distillation.teacher_tokenizer, teacher.tokenizer,
                                     teacher.max_positions)
        vocab_map = cross.vocab_map
        logger.info(f"cross-tokenizer: {vocab_map.mapped} of the teacher's {len(vocab_map.teacher_to_student)} ids are "
                    f"student tokens (map {vocab_map.fingerprint()})")
    else:
        check_tokenizers(tokenizer, teacher, str(args.distillation.teacher_path))
    manifest = planned_manifest(args, tokenizer, cross)
    settle_manifest(cache_dir, manifest)
    world, rank = topo.world_size, topo.global_rank
    replicas, replica, writer = world // tp, rank // tp, rank % tp == 0  # replicas are consecutive ranks
    if rank == 0:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if not (cache_dir / "cache.json").is_file():
            manifest.write(cache_dir)
    barrier(topo, "cache manifest")
    mine = [i for i in range(manifest.n_shards) if i % replicas == replica]
    todo = shards_to_write(cache_dir, mine, tp_group, topo.device)
    logger.info(f"cache rank {rank}: {len(mine)} shard(s) of {manifest.n_shards}, {len(mine) - len(todo)} already "
                f"written, {len(todo)} to write ({manifest.shard_sequences} windows of {args.data.seq_len} tokens each)"
                + (f"; tensor-parallel replica {replica} of {tp} ranks" + ("" if writer else ", not writing")
                   if tp > 1 else ""))
    write_shards(args, StreamReader(args, tokenizer, cache_dir, manifest), teacher, manifest, todo, writer, topo, cross)
    barrier(topo, "every shard written")
    tokens_per_shard = manifest.shard_sequences * args.data.seq_len
    if cross is None:  # another tokenizer's teacher has no CE per student token (the config decides: every rank skips)
        manifest.teacher_heldout_ce, manifest.teacher_heldout_bpb = heldout_reference(
            args, tokenizer, teacher, manifest, topo, replica, replicas, writer)
    if rank == 0:
        manifest.write(cache_dir)
        missing = [i for i in range(manifest.n_shards) if shard_metadata(shard_path(cache_dir, i)) is None]
        if missing:
            raise RuntimeError(f"shards {missing[:5]} are not complete after every rank finished; rerun the command")
        write_json_atomic(cache_dir / INDEX, {"shards": [shard_path(cache_dir, i).name for i in range(manifest.n_shards)],
                                               "tokens": manifest.n_shards * tokens_per_shard})
        reference = "" if manifest.teacher_heldout_ce is None else \
            f"; the teacher's held-out CE is {manifest.teacher_heldout_ce:.4f} ({manifest.teacher_heldout_bpb:.4f} " \
            f"bits per byte)"
        logger.info(f"teacher cache complete in {cache_dir}: {manifest.n_shards} shards, "
                    f"{manifest.n_shards * tokens_per_shard:,} tokens{reference}")
    barrier(topo, "cache index")


def write_shards(args: TeacherCacheArgs, streams: StreamReader, teacher: TeacherModel, manifest: CacheManifest,
                 todo: list[int], writer: bool, topo, cross: Optional[CrossTokenizerTeacher] = None) -> None:
    """Shards `todo`: windows read ahead (and aligned there, cross-tokenizer), the teacher's forward here, encoding
    and writing in worker processes (`encode_workers`; 0: each in turn on this thread). Same bytes either way
    (lingua/distillation/cache/writer.py)."""
    pipelined = args.encode_workers != 0
    workers = (auto_encode_workers() if args.encode_workers < 0 else args.encode_workers) if pipelined and writer else 0
    clock = StageClock()

    def read(index: int) -> tuple:
        stream, chunk, batch, loader_state = streams.shard_windows(index)
        if cross is not None:  # on the read-ahead thread: the alignment is host work, off the teacher's
            batch = align_windows(cross, batch, manifest, args.forward_rows)
        return stream, chunk, batch, loader_state

    windows = WindowReadAhead(read, todo, clock, depth=READ_AHEAD if pipelined else 0)
    shards = ShardWriters(workers, clock)
    last_report, tokens_per_shard = clock.start, manifest.shard_sequences * args.data.seq_len
    if writer:
        logger.info(f"cache rank {topo.global_rank}: " + (f"{workers} encode worker(s), windows read ahead"
                                                           if pipelined else "serial writer (encode_workers=0)"))
    try:
        for index, (stream, chunk, batch, loader_state) in windows:
            since = time.perf_counter()
            generator = torch.Generator(device=topo.device).manual_seed(args.distillation.seed * 1_000_003 + index)
            outputs = teacher_outputs(teacher, batch, manifest, args.forward_rows, generator, cross)
            clock.add("teacher", since)
            if not writer:  # its part of the outputs went to the replica's first rank
                continue
            tokens = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
            shards.submit(index, shard_path(streams.cache_dir, index), tokens, batch["doc_ids"], outputs, manifest,
                          dict(shard=index, stream=stream, chunk=chunk, loader_state=loader_state),
                          torch.as_tensor(batch["source_ids"]) if manifest.source_names is not None else None)
            if time.perf_counter() - last_report > PROGRESS_EVERY_S:
                last_report = report_progress(topo.global_rank, shards.written, len(todo), tokens_per_shard, clock)
        shards.drain()
        if writer and todo:
            report_progress(topo.global_rank, shards.written, len(todo), tokens_per_shard, clock)
    finally:
        windows.close()
        shards.close()


def report_progress(rank: int, written: int, total: int, tokens_per_shard: int, clock: StageClock) -> float:
    """The progress line: shards written, tokens/s, ETA, and where the writer's time went."""
    now = time.perf_counter()
    rate = written * tokens_per_shard / max(now - clock.start, 1e-9)
    eta = format_duration((total - written) * tokens_per_shard / rate) if rate > 0 else "unknown"
    logger.info(f"cache rank {rank}: {written}/{total} shards, {written * tokens_per_shard:,} tokens, {rate:,.0f} "
                f"tokens/s, ETA {eta}; {clock.shares()}")
    return now


def barrier(topo, what: str) -> None:
    if topo.distributed:
        log_collective(f"barrier {what}", dist.group.WORLD)
        dist.barrier(group=dist.group.WORLD)  # every rank of this job writes the cache


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(TeacherCacheArgs, argv)
    launch = read_launch_env()
    args.validate(launch.world_size, launch.local_world_size)  # every config error, before any process group
    release_sigterm()
    failure: Optional[BaseException] = None  # an exceptional exit aborts the process groups (clean_up)
    try:
        topo = setup_torch_distributed(args.distributed, 0, args.dump_dir)
        init_logger(topo.global_rank, "cache", str(Path(args.cache_dir) / "logs" / f"rank_{topo.global_rank}.log"))
        write_cache(args, topo)
    except BaseException as err:
        failure = err
        raise
    finally:
        clean_up(failure)


if __name__ == "__main__":
    run_cli(main)
