"""Host -> device copies that do not block the host: the hot paths' only way to move a host tensor to the GPU.

On CUDA a copy from pageable memory, or one without `non_blocking`, makes the host wait for the stream: every
kernel queued before it (a whole forward) runs first. From pinned (page-locked) memory with `non_blocking=True`
the copy is queued like a kernel. `pins(device)` says when host buffers are pinned (the trainer's feed asks
`device.type == "cuda"`, the same answer; tests/host_sync.py's emulated device says yes here too).
"""

from dataclasses import fields, is_dataclass, replace

import torch

PINNED_DEVICE_TYPES = {"cuda"}  # devices whose host-side buffers are pinned


def pins(device: torch.device) -> bool:
    """Whether host buffers bound for `device` are pinned (their copies then do not block the host)."""
    return torch.device(device).type in PINNED_DEVICE_TYPES


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without blocking the host: a host tensor is pinned first (where `pins`) and copied
    with non_blocking; one already there is returned as it is."""
    if tensor.device == torch.device(device):
        return tensor
    if pins(device) and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def pin_tree(value):
    """`value` with every host tensor in it pinned: tensors, lists, tuples, dicts and dataclasses (a batch's
    TeacherOutputs and its list of several teachers' outputs), anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value if value.is_pinned() else value.pin_memory()
    if isinstance(value, dict):
        return {key: pin_tree(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pin_tree(item) for item in value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: pin_tree(getattr(value, f.name)) for f in fields(value) if f.init})
    return value
