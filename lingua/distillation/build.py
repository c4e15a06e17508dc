"""Which Distiller a student gets (`build_distiller`): none, one teacher's bridge or cache, several teachers'
bridges or caches; and the teacher look-ahead every student agrees on (`agreed_prefetch`)."""

import contextlib
import logging
import os
from typing import Optional

import torch

from lingua.distillation.args import DistillationArgs, resolve_prefetch
from lingua.distillation.online.client import TeacherClient
from lingua.distillation.distiller import CacheDistiller, Distiller, NoDistiller, OnlineDistiller, tokenizer_vocab
from lingua.distillation.mixed_distillers import CachedTeachersDistiller, SeveralTeachersDistiller
from lingua.distillation.mixture import handshake_clients, source_routing
from lingua.parallel.collectives import agree_count

logger = logging.getLogger(__name__)


def build_distiller(enable_distillation: bool, args: DistillationArgs, topo, tokenizer, max_batch: tuple[int, int],
                    attn_mask: str = "causal", cache=None, phases=None, source_names: Optional[list[str]] = None
                    ) -> Distiller:
    """The Distiller for this student: none, the offline cache (`cache`: its CacheLoader) or the online bridge
    (whose handshake runs here, announcing `max_batch` = the largest (batch, seq_len) this student sends); with
    several teachers one bridge each, routed by the data sources `source_names` (a batch's source_ids index it)."""
    if not enable_distillation:
        return NoDistiller(args)
    if cache is not None and args.teachers:
        heldout = [(c.manifest.teacher_heldout_ce, c.manifest.teacher_heldout_bpb) for c in cache.loaders]
        # the caches' own source order: their shards' source ids index it (the students may list data.sources in
        # another order; the caches were checked to hold the same sources and the same windows)
        names = cache.manifest.source_names or source_names or []
        return CachedTeachersDistiller(args, source_routing(args.teachers, names), topo.device, heldout)
    if cache is not None:
        return CacheDistiller(args, cache.manifest.teacher_heldout_ce, cache.manifest.teacher_heldout_bpb)
    vocab = tokenizer_vocab(tokenizer)
    with phases.span("teacher_handshake") if phases is not None else contextlib.nullcontext():
        if args.teachers:
            clients = handshake_clients(args, topo, vocab, tokenizer.n_words, max_batch, attn_mask)
            return SeveralTeachersDistiller(args, clients, agreed_prefetch(args, topo),
                                            source_routing(args.teachers, source_names or []))
        client = TeacherClient(args, topo, vocab, tokenizer.n_words, *max_batch, attn_mask)
    return OnlineDistiller(args, client, agreed_prefetch(args, topo))


def agreed_prefetch(args: DistillationArgs, topo) -> int:
    """The teacher look-ahead every student uses: distillation.prefetch, "auto" resolved from this launch (one
    gather over the students: a bridge's students must send the same requests, e.g. before a STOP)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    prefetch, why = resolve_prefetch(args.prefetch, topo.device.type, topo.local_world_size, torch.get_num_threads(),
                                     cores)
    prefetch = agree_count(prefetch, topo.train_group, topo.device, "teacher look-ahead (distillation.prefetch)",
                           mode="min")
    if topo.is_train_master:
        logger.info(f"teacher look-ahead: prefetch={prefetch} ({why})")
    return prefetch
