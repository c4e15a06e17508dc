"""A device emulated on the CPU, to find host syncs by construction (tests/unit/test_host_sync.py uses it).

    with HostSyncGuard() as guard:            # DEVICE (= cpu:0) is "the GPU", plain cpu tensors are "the host"
        guard.mark_device(*model.parameters())
        ... warm-up (shapes seen once, first-step work) ...
        with guard.watching():                # the hot path: every host sync in here is recorded
            ...
    assert not guard.syncs, guard.report()

A tensor is on the device when its storage is: made by a factory op with device=DEVICE, copied there with
`.to(DEVICE)`, marked, or computed from a device tensor (views share its storage). Tensors report `.device` as
DEVICE, so code that moves host tensors with `.to(x.device)` makes a visible copy, as it would on CUDA. Recorded,
each with the call site of our code that made it (what blocks the host on CUDA):
  h2d_blocking   a copy host -> device without non_blocking (`.to`, `copy_`, `torch.tensor(..., device=)`, and a
                 Python number or host tensor written into a device tensor: `x[i] = 3` copies a CPU scalar)
  h2d_pageable   a non_blocking copy host -> device from memory that is not pinned (CUDA stages it synchronously)
  d2h            a blocking copy device -> host (`.cpu()`, `.to("cpu")`, `.tolist()`, `.numpy()`)
  item           a device value read on the host (`.item()`, `int()`, `float()`, `bool()`)
  data_dependent an op whose output shape depends on device values (nonzero, boolean-mask indexing, unique, ...)
`pin_memory()` is emulated too (a pinned copy the guard remembers). Storages of device tensors are kept alive
while the guard is on, so a freed device address is never taken for a host tensor's.
"""

import contextlib
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
DEVICE = torch.device("cpu", 0)
HOST = torch.device("cpu")
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.is_nonzero.default, aten.equal.default,
                  aten.repeat_interleave.Tensor}
FACTORY_KWARG = "device"


@dataclass(frozen=True)
class Sync:
    kind: str
    where: str  # path:line function of the innermost frame in lingua/ or apps/
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:15s} {self.where}  {self.detail}"


def call_site() -> tuple[str, str, str]:
    """(path from lingua/ or apps/, function, 'path:line function') of the innermost frame of our code."""
    for frame in reversed(traceback.extract_stack()):
        parts = Path(frame.filename).parts
        ours = [i for i, part in enumerate(parts) if part in ("lingua", "apps")]
        if ours and "host_sync" not in frame.filename:
            path = "/".join(parts[ours[-1]:])
            return path, frame.name, f"{path}:{frame.lineno} {frame.name}"
    return "?", "?", "?"


class HostSyncGuard(TorchDispatchMode):
    """The CPU as host and device (module docstring). `allowed`: (file name, function, kind) of syncs that are
    meant (each with its reason in the test), not recorded."""

    def __init__(self, allowed: tuple = ()):
        super().__init__()
        self.allowed = set(allowed)
        self.device_storages: dict[int, object] = {}  # data_ptr -> the storage, kept alive
        self.pinned: dict[int, torch.Tensor] = {}
        self.syncs: list[Sync] = []
        self.watch = False
        self._patched: list[tuple[object, str, object]] = []

    # ---- what is where

    @staticmethod
    def _ptr(t: torch.Tensor) -> int:
        if isinstance(t, FakeTensor):  # DTensor's sharding propagation computes on these: no storage of ours
            return 0
        try:  # a DTensor (tensor-parallel teacher) by its local shard: the mode sees its ops, not theirs
            return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()
        except Exception:  # meta, sparse, a subclass without storage
            return 0

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._ptr(t) in self.device_storages

    def mark_device(self, *tensors: torch.Tensor) -> None:
        """These tensors (parameters, buffers received over a bridge) live on the device."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and (ptr := self._ptr(t)):
                self.device_storages[ptr] = getattr(t, "_local_tensor", t).untyped_storage()

    def mark_module(self, module: torch.nn.Module) -> None:
        """The module's parameters and buffers (a DTensor's local shard) live on the device."""
        self.mark_device(*(getattr(t, "_local_tensor", t) for t in (*module.parameters(), *module.buffers())))

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of device tensor `t` on the host (what `.cpu()` gives on CUDA)."""
        out = t.clone()
        self.device_storages.pop(self._ptr(out), None)
        return out

    def _pinned(self, t: torch.Tensor) -> bool:
        return self._ptr(t) in self.pinned

    # ---- recording

    def record(self, kind: str, detail: str = "") -> None:
        if not self.watch:
            return
        file, function, where = call_site()
        if (file, function, kind) in self.allowed:
            return
        self.syncs.append(Sync(kind, where, detail))

    @contextlib.contextmanager
    def watching(self):
        """Record the host syncs made inside."""
        self.watch = True
        try:
            yield self
        finally:
            self.watch = False

    def report(self) -> str:
        return "host syncs on the hot path:\n" + "\n".join(f"  {s}" for s in dict.fromkeys(self.syncs))

    def _h2d(self, src: torch.Tensor, non_blocking: bool, how: str) -> None:
        if src.numel() == 0:
            return
        if not non_blocking:
            self.record("h2d_blocking", f"{how} of {tuple(src.shape)} {src.dtype}")
        elif not self._pinned(src):
            self.record("h2d_pageable", f"{how} of {tuple(src.shape)} {src.dtype} from pageable memory")

    # ---- the dispatcher: where results live, and the syncs it sees

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pin = kwargs.get("pin_memory", False)
        if pin:  # no accelerator here: a plain host tensor that the guard remembers as pinned
            kwargs = {**kwargs, "pin_memory": False}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_in = any(self.on_device(t) for t in inputs)
        moving = func.overloadpacket in (aten._to_copy, aten.to)  # aten.to itself under inference_mode
        if moving:
            target, non_blocking = self._to_target(func, args, kwargs)
            src = args[0]
            if target == DEVICE and not self.on_device(src):
                self._h2d(src, non_blocking, ".to(device)")
            elif target == HOST and self.on_device(src) and not non_blocking:
                self.record("d2h", f".to('cpu') of {tuple(src.shape)}")
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if self.on_device(dst) and not self.on_device(src):
                self._h2d(src, non_blocking, "copy_ into a device tensor (or a Python number written into one)")
            elif self.on_device(src) and not self.on_device(dst) and not non_blocking:
                self.record("d2h", f"copy_ of {tuple(src.shape)} into a host tensor")
        elif func is aten._local_scalar_dense.default and device_in:
            self.record("item", f"a device value read on the host ({tuple(args[0].shape)})")
        elif device_in and (func in DATA_DEPENDENT or self._mask_indexing(func, args)):
            self.record("data_dependent", f"{func} (output shape from device values)")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if moving:
            to_device = target == DEVICE or (target is None and device_in)
            if to_device and not device_in and any(self._ptr(t) == self._ptr(args[0]) for t in outputs):
                raise AssertionError("a host tensor moved to the emulated device kept its storage")
        elif not inputs:  # a factory
            to_device = kwargs.get(FACTORY_KWARG) == DEVICE
        else:
            to_device = device_in and func is not aten.copy_.default
        if to_device:
            self.mark_device(*outputs)
        if pin:
            for t in outputs:
                self.pinned[self._ptr(t)] = t
        return out

    @staticmethod
    def _to_target(func, args, kwargs) -> tuple[Optional[torch.device], bool]:
        """(target device or None, non_blocking) of an aten._to_copy / aten.to call."""
        if func is aten.to.device:  # (self, device, dtype, non_blocking, copy, memory_format)
            return torch.device(args[1]), bool(args[3] if len(args) > 3 else kwargs.get("non_blocking", False))
        if func in (aten.to.dtype, aten.to.other):  # to(dtype[, non_blocking]); to(other tensor): same device here
            return None, bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        device = kwargs.get("device")
        return (None if device is None else torch.device(device)), bool(kwargs.get("non_blocking", False))

    @staticmethod
    def _mask_indexing(func, args) -> bool:
        if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            return False
        indices = args[1] if len(args) > 1 else []
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)

    # ---- Python-level views of the device: what a cpu tensor cannot show the dispatcher

    def _patch(self, owner, name: str, value) -> None:
        self._patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def __enter__(self):
        guard = self
        base_device = torch._C.TensorBase.device
        tensor = torch.Tensor
        to, cpu, tolist, numpy = tensor.to, tensor.cpu, tensor.tolist, tensor.numpy
        pin_memory, is_pinned = tensor.pin_memory, tensor.is_pinned
        new_tensor, as_tensor = torch.tensor, torch.as_tensor

        def device(self):
            return DEVICE if guard.on_device(self) else base_device.__get__(self)

        def patched_to(self, *args, **kwargs):
            target, _, non_blocking, *_ = torch._C._nn._parse_to(
                *args, **{key: value for key, value in kwargs.items() if key != "copy"})
            # A no-op on the CPU, so not dispatched. Torch's own code moves tensors to the devices its C++ groups
            # them by (plain cpu here, the tensor's own GPU on CUDA): only our code's calls count.
            if target == HOST and guard.on_device(self) and not non_blocking and not _from_torch(sys._getframe(1)):
                guard.record("d2h", f".to('cpu') of {tuple(self.shape)}")
            if target == HOST and guard.on_device(self):
                return guard._to_host(to(self, *args, **kwargs))
            return to(self, *args, **kwargs)

        def patched_cpu(self, *args, **kwargs):
            if guard.on_device(self):
                guard.record("d2h", f".cpu() of {tuple(self.shape)}")
                return guard._to_host(self)
            return cpu(self, *args, **kwargs)

        def reading(original, what):
            def read(self, *args, **kwargs):
                if guard.on_device(self):
                    guard.record("d2h", f"{what} of {tuple(self.shape)}")
                return original(self, *args, **kwargs)
            return read

        def patched_pin_memory(self, *args, **kwargs):
            if guard._pinned(self):
                return self
            pinned = self.clone()
            guard.pinned[guard._ptr(pinned)] = pinned
            return pinned

        def patched_is_pinned(self, *args, **kwargs):
            return guard._pinned(self)

        def creating(original):
            def create(*args, **kwargs):
                device_arg = kwargs.get("device")
                out = original(*args, **kwargs)
                if device_arg is not None and torch.device(device_arg) == DEVICE:
                    if not (isinstance(args[0], torch.Tensor) and guard.on_device(args[0])):
                        guard.record("h2d_blocking", f"{original.__name__}(..., device=) copies host data")
                    guard.mark_device(out)
                return out
            return create

        self._patch(tensor, "device", property(device))
        self._patch(tensor, "to", patched_to)
        self._patch(tensor, "cpu", patched_cpu)
        self._patch(tensor, "tolist", reading(tolist, ".tolist()"))
        self._patch(tensor, "numpy", reading(numpy, ".numpy()"))
        self._patch(tensor, "pin_memory", patched_pin_memory)
        self._patch(tensor, "is_pinned", patched_is_pinned)
        self._patch(torch, "tensor", creating(new_tensor))
        self._patch(torch, "as_tensor", creating(as_tensor))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, value in reversed(self._patched):
                if value is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, value)
            self._patched.clear()


_MISSING = object()
TORCH_DIR = str(Path(torch.__file__).parent)


def _from_torch(frame) -> bool:
    return frame.f_code.co_filename.startswith(TORCH_DIR)


def device_copy(guard: Optional[HostSyncGuard], t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor the guard counts as on the device (a clone; `t` itself stays a host tensor)."""
    out = t.clone()
    if guard is not None:
        guard.mark_device(out)
    return out
