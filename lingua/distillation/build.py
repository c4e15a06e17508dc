"""What the trainer asks of the package: its launch's teachers (`launch_teachers`), a student's Distiller and its
teachers' caches (`build_distiller`), a teacher rank's serving (`serve_teacher`), the agreed look-ahead."""

import contextlib
import logging
import os
from typing import Optional

import torch

from lingua.distillation.args import DistillationArgs, resolve_prefetch
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.cache.reader import open_training_caches
from lingua.distillation.distiller import Distiller, NoDistiller, tokenizer_vocab
from lingua.distillation.loss.mixture import source_routing
from lingua.distillation.online.distiller import OnlineDistiller, handshake_clients
from lingua.distillation.online.server import TeacherServer
from lingua.distillation.teacher.roster import check_teachers_fit, serving_args
from lingua.loading.stream import active_sources
from lingua.parallel.collectives import agree_count
from lingua.parallel.launch_plan import TeacherLayout

logger = logging.getLogger(__name__)


def launch_teachers(enable_distillation: bool, args: DistillationArgs, data=None) -> tuple[TeacherLayout, ...]:
    """The launch's teachers with ranks of their own, in rank order (what `LaunchPlan` and `setup_torch_distributed`
    take): each online teacher's ranks, replica size and path; a cached teacher has none. `args` are validated (the
    one-teacher keys read into `teachers`). Given `data` (at validation), each is first checked to fit it."""
    if not enable_distillation:
        return ()
    if data is not None:
        check_teachers_fit(args, data)
    assert args.teachers, "validate the distillation settings first: they fill distillation.teachers"
    online = args.online_teachers() if args.source == "online" else []
    return tuple(TeacherLayout(args.teachers[i].n_teacher_ranks, args.teacher_args(i).teacher_tp,
                               args.teachers[i].path or "") for i in online)


def build_distiller(enable_distillation: bool, args: DistillationArgs, topo, tokenizer, data, attn_mask: str = "causal",
                    phases=None) -> tuple[Distiller, Optional[object]]:
    """(the Distiller for this student, the teachers' caches as its dataset or None): none, the caches (one per
    teacher with a cache_dir; one written with other settings is refused here) or the online bridges, whose handshakes
    run here announcing the largest (data.batch_size, data.seq_len) this student sends, with any cached teacher's
    targets from the batches beside them. Several teachers are routed by the data sources: a batch's source_ids index
    the caches' own order when there is a cache, else data.sources' active ones."""
    if not enable_distillation:
        return NoDistiller(args), None
    cache = open_training_caches(args, data, attn_mask, tokenizer, data.batch_size, topo.train_rank,
                                 topo.train_world_size)
    heldout = [(None, None)] * len(args.teachers)
    source_names = active_sources(data.sources)
    if cache is not None:
        # the caches' own source order: their shards' source ids index it (the students may list data.sources in
        # another order; the caches were checked to hold the same sources and the same windows)
        source_names = cache.manifest.source_names or source_names
        for i, manifest in zip([i for i, t in enumerate(args.teachers) if t.cache_dir], cache.manifests):
            heldout[i] = (manifest.teacher_heldout_ce, manifest.teacher_heldout_bpb)
    routing = source_routing(args.teachers, source_names or [])
    if not args.online_teachers():
        distiller = CacheDistiller(args, routing, topo.device, heldout)
    else:
        with phases.span("teacher_handshake") if phases is not None else contextlib.nullcontext():
            clients = handshake_clients(args, topo, tokenizer_vocab(tokenizer), tokenizer.n_words,
                                        (data.batch_size, data.seq_len), attn_mask)
        distiller = OnlineDistiller(args, clients, agreed_prefetch(args, topo), routing, heldout)
    distiller.phases = phases
    return distiller, cache


def serve_teacher(args: DistillationArgs, topo, preemption, timeouts: Optional[tuple[float, float]],
                  **server_options) -> None:
    """A teacher rank: the teacher it serves (the one of its bridge), loaded; the handshake with its
    students, then their requests until STOP. `timeouts`: (until the first step, after it); `server_options`: the
    rest of `TeacherServer`'s arguments."""
    kd, teacher_names = serving_args(args, topo)
    server = TeacherServer(kd, topo, preemption, teacher_names=teacher_names, **server_options)
    server.serve(timeouts=timeouts)


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
