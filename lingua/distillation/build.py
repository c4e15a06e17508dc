"""Which Distiller a student gets (`build_distiller`): none, the teachers' caches, or their bridges (and any cached
teacher beside them); and the teacher look-ahead every student agrees on (`agreed_prefetch`)."""

import contextlib
import logging
import os
from typing import Optional

import torch

from lingua.distillation.args import DistillationArgs, resolve_prefetch
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.distiller import Distiller, NoDistiller, tokenizer_vocab
from lingua.distillation.loss.mixture import source_routing
from lingua.distillation.online.distiller import OnlineDistiller, handshake_clients
from lingua.parallel.collectives import agree_count

logger = logging.getLogger(__name__)


def build_distiller(enable_distillation: bool, args: DistillationArgs, topo, tokenizer, max_batch: tuple[int, int],
                    attn_mask: str = "causal", cache=None, phases=None, source_names: Optional[list[str]] = None
                    ) -> Distiller:
    """The Distiller for this student: none, the teachers' caches (`cache`: their `TeacherCaches`) or the online
    bridges (whose handshakes run here, announcing `max_batch` = the largest (batch, seq_len) this student sends),
    with any cached teacher's targets from the batches beside them; several teachers are routed by the data sources
    (a batch's source_ids index them: the caches' own order when there is a cache, else `source_names`)."""
    if not enable_distillation:
        return NoDistiller(args)
    heldout = [(None, None)] * len(args.teachers)
    if cache is not None:
        # the caches' own source order: their shards' source ids index it (the students may list data.sources in
        # another order; the caches were checked to hold the same sources and the same windows)
        source_names = cache.manifest.source_names or source_names
        for i, manifest in zip([i for i, t in enumerate(args.teachers) if t.cache_dir], cache.manifests):
            heldout[i] = (manifest.teacher_heldout_ce, manifest.teacher_heldout_bpb)
    routing = source_routing(args.teachers, source_names or [])
    if not args.online_teachers():
        return CacheDistiller(args, routing, topo.device, heldout)
    with phases.span("teacher_handshake") if phases is not None else contextlib.nullcontext():
        clients = handshake_clients(args, topo, tokenizer_vocab(tokenizer), tokenizer.n_words, max_batch, attn_mask)
    return OnlineDistiller(args, clients, agreed_prefetch(args, topo), routing, heldout)


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
