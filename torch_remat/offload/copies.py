"""Copies between a device tensor and a host buffer: on CUDA asynchronous, on a side
stream with events; elsewhere synchronous, through the same calls."""

from __future__ import annotations

from typing import Any

import torch


def host_view(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A tensor in ``buffer`` shaped like ``t``: with ``t``'s strides when ``t`` is
    dense (a permuted view keeps its layout, so backward kernels see the same
    strides), contiguous otherwise."""
    flat = buffer[: t.numel() * t.element_size()].view(t.dtype)
    if is_dense(t):
        return flat.as_strided(t.shape, t.stride())
    return flat.view(t.shape)


def is_dense(t: torch.Tensor) -> bool:
    """No gaps and no overlap: the elements fill exactly ``numel`` slots."""
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return True
        if size > 1 and stride == 0:
            return False
        span += (size - 1) * abs(stride)
    return span == t.numel()


class SyncCopier:
    """Copies that are done when the call returns (CPU, or any non-CUDA device)."""

    def to_host(self, t: torch.Tensor, host: torch.Tensor) -> Any:
        host.copy_(t)
        return None

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        out.copy_(host)
        return out, None

    def wait(self, ready: Any, t: torch.Tensor) -> None:
        pass


class CudaCopier:
    """Copies on one side stream per device, ordered after the compute that produced
    the tensor; each returns the event that marks its end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def to_host(self, t: torch.Tensor, host: torch.Tensor) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            # The allocator must not reuse t's memory before the copy has read it.
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def wait(self, ready: Any, t: torch.Tensor) -> None:
        """Make the current stream wait for ``ready`` before it uses ``t``."""
        if ready is None:
            return
        current = torch.cuda.current_stream(t.device)
        current.wait_event(ready)
        t.record_stream(current)
