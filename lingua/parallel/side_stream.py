"""Asynchronous collectives posted off the compute stream (the bridge's requests and replies).

    side = SideStream(device)
    with side.posting():                      # allocate and post here: NCCL waits on nothing queued for compute
        buf = host.to(device, non_blocking=True); work = dist.gather(buf, ..., group=g, async_op=True)
    side.consume([work], [buf])               # the compute stream now comes after `work`; the host goes on

ProcessGroupNCCL makes its communicator's stream wait on the stream current at the post: posted from the compute
stream, a collective leaves only after every kernel queued before it. From a side stream whose only work is the
copy of its input, it leaves when posted. On CPU (gloo) there is no side stream and `wait()` blocks the host.
docs/distillation_internals.md#what-nccl-orders says what NCCL orders and where the host truly waits.
"""

import contextlib

import torch


class SideStream:
    """A side CUDA stream to post collectives on (a no-op on CPU). Buffers allocated under `posting()` are reused by
    the allocator only behind this stream, which waits for each work before the compute stream does."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def posting(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def consume(self, works, buffers: list[torch.Tensor]) -> None:
        """Wait for `works` on the side stream (NCCL releases their inputs to a stream ordered after them), then order
        the compute stream after it and mark `buffers` used there, so their memory outlives its reads of them."""
        with self.posting():
            for work in works:
                work.wait()
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.stream.device)
            compute.wait_stream(self.stream)
            for buffer in buffers:
                buffer.record_stream(compute)
