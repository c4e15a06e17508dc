"""No host sync on any road's hot path, found by construction: the student's micro-batch loop and optimizer step,
and the teacher's per-request path (forward and reply), run on a device emulated on the CPU (tests/host_sync.py)
for every road: CE only, online, a cache, several teachers (online and cached), cross-tokenizer (online and cached,
top-k and sampled), a tensor-parallel teacher. A blocking host -> device copy, a non_blocking one from pageable
memory, `.item()`, `.tolist()`, `.cpu()` or an op whose output shape depends on device values fails the test with
its call site. The first step (or request) warms up; the next is watched. About 40 s on 2 cores.

The syncs the code means to make, each with its reason, are the only ones allowed (ALLOWED)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from apps.main.train import optimizer_step, train_step, TrainArgs
from apps.main.transformer import LMTransformer, LMTransformerArgs
from lingua.distillation.args import DistillationArgs, TeacherArgs
from lingua.distillation.online.bridge import BridgeSpec, Op, RECORD_BYTES, RequestHeader, ResponseStatus
from lingua.distillation.online.client import TeacherClient
from lingua.distillation.cache.distiller import CacheDistiller
from lingua.distillation.distiller import NoDistiller
from lingua.distillation.loss.mixture import source_routing
from lingua.distillation.online.distiller import OnlineDistiller
from lingua.distillation.micro_batches import MicroBatchFeed
from lingua.distillation.outputs import TeacherOutputs
from lingua.optim import OptimArgs, build_optimizer
from lingua.timing import StepTimer
from tests.host_sync import DEVICE, HostSyncGuard, device_copy

V, B, S, K = 64, 2, 16, 8  # the student's vocabulary, micro-batch rows, positions, top-k
STEPS, GRAD_ACC = 2, 2  # the first step warms up, the second is watched

ALLOWED = {
    # The teacher reads each request's header on the host: the shapes of the forward come from it (on NCCL this
    # read is where the wait for the request really ends), before anything is queued.
    ("lingua/distillation/online/server.py", "_headers", "d2h"),
    # A cross-tokenizer leader aligns the students' tokens on its CPU: they come to the host once per request,
    # before the teacher's forward is queued.
    ("lingua/distillation/online/server.py", "_cross_forward_rows", "d2h"),
    # transformers' create_causal_mask looks for packed sequences in the position ids it made itself, with a host
    # read (masking_utils.find_packed_sequence_indices: `.all()`), at the start of each decoder call: only the
    # embedding is queued by then (a tensor-parallel teacher's DTensor shows it as an item read). Upstream's;
    # docs/gpu/README.md lists it for a GPU profile to size.
    ("lingua/distillation/teacher/model.py", "_decoder", "data_dependent"),
    ("lingua/distillation/teacher/model.py", "_decoder", "item"),
}


@pytest.fixture
def guard(monkeypatch):
    """The emulated device, which pins host buffers as CUDA does."""
    monkeypatch.setattr("lingua.parallel.host_copies.PINNED_DEVICE_TYPES", {"cuda", "cpu"})
    with HostSyncGuard(ALLOWED) as guard:
        yield guard


def topk_outputs(generator, shape, cross=False) -> TeacherOutputs:
    logits = torch.randn(*shape, V, generator=generator)
    values, ids = logits.log_softmax(-1).topk(K)
    rest = (1 - values.exp().sum(-1)).clamp_min(0)
    kd_weight = (torch.rand(shape, generator=generator) > 0.3).float() if cross else None
    return TeacherOutputs("topk", values.bfloat16(), ids.int(), rest.float(), kd_weight)


def host_batches(generator, teachers: int = 0, cross=(), sources: bool = False):
    """Endless loader batches (host tensors), with a cache's targets per teacher when `teachers`."""
    while True:
        tokens = torch.randint(0, V, (B, S + 1), generator=generator)
        batch = {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}
        batch["labels"][0, :3] = -100
        if sources:
            batch["source_ids"] = torch.tensor([0, 1], dtype=torch.int32)
        if teachers:  # the caches' reader gives a list, one per teacher, one teacher included
            batch["teachers"] = [topk_outputs(generator, (B, S), i in cross) for i in range(teachers)]
        yield batch


class Loader:
    def __init__(self, batches):
        self.batches, self.drawn = batches, 0

    def __next__(self):
        self.drawn += 1
        return next(self.batches)

    def state_dict(self):
        return {"drawn": self.drawn, "bad_lines": 0}


def run_student(guard: HostSyncGuard, distiller, batches, prefetch: int = 1, implementation: str = "fused"):
    """STEPS optimizer steps of a tiny student on the emulated device; the steps after the first are watched."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LMTransformer(LMTransformerArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=V,
                                                max_seqlen=S))
        model.init_weights()
    guard.mark_module(model)
    optimizer, scheduler = build_optimizer(model, OptimArgs(implementation=implementation), STEPS)
    feed = MicroBatchFeed(Loader(batches), distiller, GRAD_ACC, prefetch, STEPS, pin_memory=True)
    timer, args = StepTimer(DEVICE), TrainArgs()
    for step in range(1, STEPS + 1):
        timer.reset()
        with guard.watching() if step > 1 else contextlib.nullcontext():
            metrics, _ = train_step(args, model, distiller, feed, step, timer, DEVICE, scheduler.get_last_lr()[0])
            optimizer_step(model, optimizer, scheduler, 1.0, timer)
            distiller.control_flags()
        assert all(guard.on_device(value) for key, value in metrics.items() if isinstance(value, torch.Tensor))
    return guard.syncs


class FakeWork:
    def wait(self):
        return True


def fake_bridge(monkeypatch, guard: HostSyncGuard, specs: list[BridgeSpec], generator):
    """The bridges' collectives in-process: each scatter delivers a valid response already on the device."""
    responses = {}
    for spec in specs:
        response = torch.zeros(spec.response_bytes(), dtype=torch.uint8)
        response[:RECORD_BYTES] = ResponseStatus(ok=True, teacher_preempt=False, busy_s=0, idle_s=0, peak_bytes=0,
                                                 forward_s=0).pack()
        outputs = topk_outputs(generator, (spec.max_bsz, spec.max_seqlen), spec.kd_weight)
        for view, value in zip(spec.payload_views(response), outputs.tensors()):
            view.copy_(value)
        responses[spec.response_bytes()] = device_copy(guard, response)

    def scatter(output, inputs, src, group, async_op):
        output.copy_(responses[output.numel()])  # on the device: what NCCL writes
        return FakeWork()
    monkeypatch.setattr("lingua.distillation.online.client.dist.scatter", scatter)
    monkeypatch.setattr("lingua.distillation.online.client.dist.gather", lambda *args, **kwargs: FakeWork())


def client(args: DistillationArgs, spec: BridgeSpec, teacher_rank: int) -> TeacherClient:
    topo = SimpleNamespace(is_student=True, bridge_group=object(), my_teacher=teacher_rank, device=DEVICE,
                           train_rank=0, global_rank=0)
    return TeacherClient(args, topo, {}, V, B, S, spec=spec)


def spec(cross: bool = False) -> BridgeSpec:
    return BridgeSpec(B, S, V, "topk", K, torch.bfloat16, kd_weight=cross)


SEVERAL = DistillationArgs(teachers=[TeacherArgs(path="/t/a", weight=2.0), TeacherArgs(path="/t/b", sources=["code"],
                                                                                      cross_tokenizer=True)], k=K)


def one_teacher(args: DistillationArgs) -> DistillationArgs:
    """A lone teacher as validation reads it: a list of one."""
    args.teachers = [args.lone_teacher()]
    return args


def student_road(road: str, guard: HostSyncGuard, monkeypatch):
    """(distiller, loader batches) of a road, its bridges faked."""
    generator = torch.Generator().manual_seed(1)
    routing = source_routing(SEVERAL.teachers, ["text", "code"])
    if road == "ce":
        return NoDistiller(DistillationArgs()), host_batches(generator)
    if road in ("cache", "cache_cross"):
        cross = road == "cache_cross"
        args = one_teacher(DistillationArgs(k=K, source="cache", cache_dir="/c", cross_tokenizer=cross))
        distiller = CacheDistiller(args, None, DEVICE, [(None, None)])  # a lone teacher is not routed
        return distiller, host_batches(generator, 1, cross=(0,) if cross else ())
    if road == "cached_teachers":
        distiller = CacheDistiller(SEVERAL, device_copy(guard, routing), DEVICE, [(None, None)] * 2)
        return distiller, host_batches(generator, 2, cross=(1,), sources=True)
    if road in ("online", "online_cross"):
        cross = road == "online_cross"
        fake_bridge(monkeypatch, guard, [spec(cross)], generator)
        args = one_teacher(DistillationArgs(teacher_path="/t/a", k=K, cross_tokenizer=cross))
        distiller = OnlineDistiller(args, [client(args, spec(cross), 1)], 1, None, [(None, None)])
        return distiller, host_batches(generator)
    assert road == "several_online"
    fake_bridge(monkeypatch, guard, [spec(False), spec(True)], generator)
    clients = [client(SEVERAL, spec(False), 1), client(SEVERAL, spec(True), 2)]
    return OnlineDistiller(SEVERAL, clients, 1, device_copy(guard, routing), [(None, None)] * 2), host_batches(
        generator, sources=True)


@pytest.mark.parametrize("road", ["ce", "online", "online_cross", "several_online", "cache", "cache_cross",
                                  "cached_teachers"])
def test_the_students_step_makes_no_host_sync(road, guard, monkeypatch):
    distiller, batches = student_road(road, guard, monkeypatch)
    syncs = run_student(guard, distiller, batches)
    assert not syncs, guard.report()


@pytest.mark.parametrize("implementation", ["for_loop", "foreach"])  # fused: every road above
def test_each_optimizer_implementation_steps_without_a_host_sync(implementation, guard):
    syncs = run_student(guard, NoDistiller(DistillationArgs()), host_batches(torch.Generator().manual_seed(2)),
                        implementation=implementation)
    assert not syncs, guard.report()


# ---------------------------------------------------------------- the teacher's per-request path

def teacher_server(guard, tiny_teacher, output: str, cross: bool, link=None):
    """A leader TeacherServer on the emulated device (built without its constructor's handshake and process
    groups), serving two students."""
    from lingua.distillation.cross_tokenizer.teacher_side import load_cross_tokenizer
    from lingua.distillation.online.serving_clock import ServingClock
    from lingua.distillation.online.server import TeacherServer
    from lingua.distillation.teacher.model import TeacherModel
    from lingua.metrics import MemoryMonitor
    from lingua.parallel.preemption import PreemptionFlag
    from lingua.tokenizer import TokenizerArgs

    args = DistillationArgs(teacher_path=str(tiny_teacher), k=K, output=output, cross_tokenizer=cross)
    teacher = TeacherModel(args, torch.device("cpu"), tp_group=link.group if link is not None else None)
    guard.mark_module(teacher.model)
    vocab = 258 if cross else teacher.vocab_size
    server = TeacherServer.__new__(TeacherServer)
    the_spec = BridgeSpec(B, S, vocab, output, K, torch.bfloat16, kd_weight=cross)
    server.__dict__.update(
        args=args, teacher=teacher, spec=the_spec, leader=True, link=link,
        cross=load_cross_tokenizer(TokenizerArgs("bytes"), None, teacher.tokenizer, None) if cross else None,
        topo=SimpleNamespace(device=DEVICE, bridge_group=object(), global_rank=2), bridge_ranks=[0, 1, 2], mine=2,
        generator=torch.Generator().manual_seed(3), clock=ServingClock(DEVICE), memory=MemoryMonitor(DEVICE),
        preemption=PreemptionFlag(), requests=0, tokens=0, teacher_names=(), replica_flags=None, nan_flags={},
        responses=[device_copy(guard, torch.zeros(the_spec.response_bytes(), dtype=torch.uint8)) for _ in range(3)])
    server.scatter_out = device_copy(guard, server.responses[2])
    return server, the_spec


def requests(guard, spec_: BridgeSpec, step: int, generator) -> list[torch.Tensor]:
    """Two students' request buffers for `step`, as the gather leaves them on the teacher's device."""
    out = []
    for rank in (0, 1):
        request = torch.zeros(spec_.request_ints(), dtype=torch.int32)
        header = RequestHeader(Op.FORWARD, step, 0, B, S, rank)
        request[:len(header.to_ints())] = torch.tensor(header.to_ints(), dtype=torch.int32)
        spec_.token_grid(request)[:B, :S] = torch.randint(32, 127, (B, S), generator=generator)
        if spec_.kd_weight:
            spec_.next_tokens(request)[:B] = 101
        out.append(device_copy(guard, request))
    return out


def serve_requests(guard, server, spec_: BridgeSpec, monkeypatch) -> list:
    """Two requests through the leader's `_handle` and `_reply`; the second is watched."""
    monkeypatch.setattr("lingua.distillation.online.server.dist.scatter", lambda *args, **kwargs: None)
    generator = torch.Generator().manual_seed(4)
    switch = SimpleNamespace(observe=lambda *args, **kwargs: None)
    for step in (1, 2):
        server.gathered = [*requests(guard, spec_, step, generator), device_copy(guard, torch.zeros(
            spec_.request_ints(), dtype=torch.int32))]
        with guard.watching() if step > 1 else contextlib.nullcontext():
            status, ops, failure = server._handle(switch)
            server._reply(status)
        assert failure is None and ops == {Op.FORWARD}, failure
        assert all(guard.on_device(flag) for flag in server.nan_flags.values())
    return guard.syncs


@pytest.mark.parametrize("output,cross", [("topk", False), ("sampled", False), ("topk", True), ("sampled", True)])
def test_the_teachers_request_path_makes_no_host_sync(output, cross, guard, tiny_teacher, monkeypatch):
    server, spec_ = teacher_server(guard, tiny_teacher, output, cross)
    assert not serve_requests(guard, server, spec_, monkeypatch), guard.report()


@pytest.mark.parametrize("cross", [False, True])
def test_a_tensor_parallel_leaders_request_path_makes_no_host_sync(cross, guard, tiny_teacher, train_group,
                                                                  monkeypatch):
    """The replica's traffic (the round, the teacher's tokens, the flags) on a 1-rank replica group: the leader's
    writes into its device buffers and what it sends."""
    from lingua.distillation.online.replica import ReplicaLink

    topo = SimpleNamespace(teacher_tp_group=train_group, replica_ranks=[0], device=DEVICE)
    spec_ = BridgeSpec(B, S, 258 if cross else 512, "topk", K, torch.bfloat16, kd_weight=cross)
    link = ReplicaLink(topo, spec_, 2)
    guard.mark_device(link.round, link.flags)
    server, spec_ = teacher_server(guard, tiny_teacher, "topk", cross, link)
    assert server.teacher.shard is not None
    assert not serve_requests(guard, server, spec_, monkeypatch), guard.report()
