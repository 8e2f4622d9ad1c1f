"""Copies between a device tensor and a host buffer: on CUDA asynchronous, on a side
stream with events; elsewhere synchronous, through the same calls."""

from __future__ import annotations

from typing import Any

import torch


class CopyLayout:
    """What moves of a tensor ``t`` and how it comes back.

    A tensor whose elements fill its storage span without gaps (dense, a permuted
    view, or a broadcast view with stride 0) moves that span, and comes back with
    its own strides: a mask expanded to (B, H, S, S) moves its (S, S) storage. A
    tensor with gaps (a strided slice) moves its elements, and comes back
    contiguous."""

    __slots__ = ("count", "shape", "stride", "span")

    def __init__(self, t: torch.Tensor) -> None:
        span = storage_span(t)
        self.shape = t.shape
        if span <= t.numel():
            self.count, self.stride, self.span = span, t.stride(), True
        else:
            self.count, self.stride, self.span = t.numel(), _contiguous_strides(t.shape), False

    def nbytes(self, t: torch.Tensor) -> int:
        return self.count * t.element_size()

    def host_view(self, buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The ``count`` elements of ``buffer`` (bytes) that hold ``t``."""
        return buffer[: self.nbytes(t)].view(t.dtype)

    def source(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(what to copy from, shape of the host view)``: the span of ``t``'s
        storage, or ``t`` itself copied into a contiguous view."""
        if self.span:
            return t.as_strided((self.count,), (1,), t.storage_offset()), None
        return t, self.shape

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.stride)


def storage_span(t: torch.Tensor) -> int:
    """How many storage elements ``t`` spans, from its first to its last."""
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        span += (size - 1) * abs(stride)
    return span


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class SyncCopier:
    """Copies that are done when the call returns (CPU, or any non-CUDA device).

    A copy back is a new tensor made by ``to(copy=True)``, at version 0 like the
    tensor that was saved (``copy_`` into an empty one would leave it at 1)."""

    def to_host(self, t: torch.Tensor, host: torch.Tensor, layout: CopyLayout) -> Any:
        src, shape = layout.source(t)
        (host if shape is None else host.view(shape)).copy_(src)
        return None

    def to_device(self, host: torch.Tensor, device: torch.device, layout: CopyLayout) -> tuple[torch.Tensor, Any]:
        return layout.rebuild(host.to(device, copy=True)), None

    def wait(self, ready: Any, t: torch.Tensor) -> None:
        pass


class CudaCopier:
    """Copies on one side stream per device, ordered after the compute that produced
    the tensor; each returns the event that marks its end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def to_host(self, t: torch.Tensor, host: torch.Tensor, layout: CopyLayout) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            src, shape = layout.source(t)
            (host if shape is None else host.view(shape)).copy_(src, non_blocking=True)
            # The allocator must not reuse t's memory before the copy has read it.
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_device(self, host: torch.Tensor, device: torch.device, layout: CopyLayout) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            out = layout.rebuild(host.to(device, copy=True, non_blocking=True))
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
