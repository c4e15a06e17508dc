"""The cache writer's job (`apps.main.teacher_cache` is its command line): every rank a teacher writing its shards,
resumable, the manifest settled first and the index last.

    write_cache(args, topo)  # args: the writer's TeacherCacheArgs (the trainer's config + cache keys)

Rank r of N (replica r of N / teacher_tp) writes shards r, r + N, ...; a rerun skips finished shards and resumes the
others from the loader state in the last finished shard of their stream.
"""

import logging
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lingua.evaluation.bits_per_byte import batches_target_bytes, bits_per_byte, token_byte_lengths
from lingua.data import DataLoader
from lingua.distillation.args import WIRE_DTYPES
from lingua.distillation.cache.store import (CONVERT_HINT, CROSS_FIELDS, INDEX, MANIFEST, CacheManifest,
                                             describe_differences, settings_manifest, shard_metadata, shard_path,
                                             write_json_atomic)
from lingua.distillation.cache.writer import READ_AHEAD, ShardWriters, StageClock, WindowReadAhead, auto_encode_workers
from lingua.distillation.cross_tokenizer.teacher_side import CrossTokenizerTeacher, load_cross_tokenizer
from lingua.distillation.distiller import tokenizer_fingerprint, tokenizer_vocab
from lingua.distillation.outputs import TeacherOutputs
from lingua.distillation.teacher.model import TeacherModel
from lingua.errors import ConfigError, DataError
from lingua.evaluation.heldout import iterate_eval_batches
from lingua.metrics import format_duration
from lingua.parallel.collectives import agree_flags, log_collective
from lingua.parallel.launch_plan import tensor_parallel_replicas
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger("teacher_cache")
PROGRESS_EVERY_S = 10.0


def planned_manifest(args, tokenizer, cross: Optional[CrossTokenizerTeacher] = None) -> CacheManifest:
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
    """A cache started with other settings is refused (every rank reads the same manifest, so all agree); one
    started by an older writer is finished in its own format version and zstd level."""
    if not (cache_dir / MANIFEST).is_file():
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

    def __init__(self, args, tokenizer, cache_dir: Path, manifest: CacheManifest):
        self.args, self.tokenizer, self.cache_dir, self.manifest = args, tokenizer, cache_dir, manifest
        self.loaders: dict[int, DataLoader] = {}
        self.next_chunk: dict[int, int] = {}

    def shard_windows(self, index: int) -> tuple[int, int, dict, dict]:
        """(stream, chunk, windows, the stream's loader state after them) of shard `index`."""
        stream, chunk = index % self.manifest.streams, index // self.manifest.streams
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
        return stream, chunk, next(loader), loader.state_dict()


def align_windows(cross: CrossTokenizerTeacher, batch: dict, manifest: CacheManifest, forward_rows: int) -> dict:
    """distillation.cross_tokenizer: a chunk's windows with each forward's rows aligned to the teacher's tokens
    (`aligned`, a TeacherBatch per forward of `forward_rows` windows), as an online teacher rank aligns them."""
    doc_causal = manifest.attn_mask == "doc_causal"
    aligned = [cross.teacher_batch(batch["input_ids"][start:start + forward_rows],
                                   batch["doc_ids"][start:start + forward_rows] if doc_causal else None,
                                   batch["labels"][start:start + forward_rows, -1])
               for start in range(0, batch["input_ids"].shape[0], forward_rows)]
    return {**batch, "aligned": aligned}


def teacher_outputs(teacher: TeacherModel, batch: dict, manifest: CacheManifest, forward_rows: int,
                    generator, cross: Optional[CrossTokenizerTeacher] = None) -> Optional[TeacherOutputs]:
    """The teacher's outputs for a chunk's windows, `forward_rows` windows per forward (tensor-parallel: on the
    replica's first rank, None on the others). Cross-tokenizer: the forward on the windows `align_windows` aligned,
    its targets mapped to the student's positions and ids, as `TeacherServer` sends them."""
    parts, wire = [], WIRE_DTYPES[manifest.wire_dtype]
    doc_causal = manifest.attn_mask == "doc_causal"
    for index, start in enumerate(range(0, batch["input_ids"].shape[0], forward_rows)):
        if cross is not None:
            aligned = batch["aligned"][index]
            hidden = teacher.hidden_states(aligned.tokens.to(teacher.device),
                                           aligned.doc_ids.to(teacher.device) if doc_causal else None)
            parts.append(cross.student_targets(teacher, hidden, aligned, manifest.output, manifest.k, wire, generator,
                                               manifest.unmapped_entries))
            continue
        rows = slice(start, start + forward_rows)
        doc_ids = batch["doc_ids"][rows].to(teacher.device) if doc_causal else None
        hidden = teacher.hidden_states(batch["input_ids"][rows].to(teacher.device), doc_ids)
        parts.append(teacher.sparse_outputs(hidden, manifest.output, manifest.k, wire, manifest.vocab_size, generator))
    if parts[0] is None:
        return None
    return TeacherOutputs.from_tensors(manifest.output, [torch.cat(ts).cpu() for ts in zip(*(p.tensors() for p in parts))])


def heldout_reference(args, tokenizer, teacher: TeacherModel, manifest: CacheManifest, topo,
                      replica: int, replicas: int, writer: bool) -> tuple[Optional[float], Optional[float]]:
    """The teacher's CE and bits per byte on the students' held-out windows, or (None, None) (no held-out files);
    the batches are split over the replicas and the sums all-reduced, so no rank idles in a collective."""
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


def check_k_fits_vocab(args, tokenizer) -> None:
    """k beyond the students' vocabulary (the top-k's ids) is refused before the teacher loads, as online."""
    k, vocab = args.distillation.k, tokenizer.n_words
    if args.distillation.output == "topk" and k > vocab:
        raise ConfigError(f"distillation.k={k} is more than the {vocab} token ids the top-k is taken from (the data "
                          f"tokenizer's vocabulary, which the students train on); set distillation.k <= {vocab}.")


def replica_group(topo, teacher_tp: int, timeout_s: float):
    """This rank's tensor-parallel group (replicas of teacher_tp consecutive ranks), or None with teacher_tp=1."""
    if teacher_tp == 1:
        return None
    mine = None
    replicas = tensor_parallel_replicas(list(range(topo.world_size)), teacher_tp, topo.local_world_size)
    for i, ranks in enumerate(replicas):  # every rank makes every group, in the same order: new_group is collective
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), group_desc=f"teacher_tp_{i}")
        if topo.global_rank in ranks:
            mine = group
            topo.group_names[id(group)] = f"teacher_tp_{i}"
    return mine


def unwritten(cache_dir: Path, indices) -> list[int]:
    return [i for i in indices if shard_metadata(shard_path(cache_dir, i)) is None]


def shards_to_write(cache_dir: Path, mine: list[int], tp_group, device) -> list[int]:
    """The shards of `mine` not written yet, as the replica's first rank sees them (its replica runs the same)."""
    todo = unwritten(cache_dir, mine)
    if tp_group is None:
        return todo
    padded = torch.full((len(mine),), -1, dtype=torch.int64, device=device)
    padded[:len(todo)] = torch.tensor(todo, dtype=torch.int64)
    log_collective("broadcast shards to write", tp_group, padded)
    dist.broadcast(padded, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return [i for i in padded.tolist() if i >= 0]


def write_cache(args, topo) -> None:
    """Write (or resume) the cache of `args.cache_dir`: this rank's shards, then the held-out line and the index."""
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
        if not (cache_dir / MANIFEST).is_file():
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
        missing = unwritten(cache_dir, range(manifest.n_shards))
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


def write_shards(args, streams: StreamReader, teacher: TeacherModel, manifest: CacheManifest,
                 todo: list[int], writer: bool, topo, cross: Optional[CrossTokenizerTeacher] = None) -> None:
    """Shards `todo`: windows read ahead (and aligned there, cross-tokenizer), the teacher's forward here, encoding
    and writing in worker processes (`encode_workers`; 0: each in turn on this thread, the same bytes)."""
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
