"""Copies between a device tensor and a host buffer: on CUDA asynchronous, on a side
stream with events; elsewhere synchronous, through the same calls."""

from __future__ import annotations

from typing import Any

import torch

from .._compat import set_version_counters


class CopyLayout:
    """What moves of a tensor ``t`` and how it comes back.

    A tensor whose elements fill its storage span without gaps (dense, a permuted
    view, or a broadcast view with stride 0) moves that span, and comes back with
    its own strides: a mask expanded to (B, H, S, S) moves its (S, S) storage. A
    tensor with gaps (a strided slice) moves only its elements, packed dense on the
    host with its dimensions in the order of its strides, and comes back with its
    own strides again, in a new storage that spans the gaps (left unwritten): kernels
    follow the layout of their input, and a full reduction of a slice with gaps
    (``x[:, :33].sum()``, the ``mean()`` in ``var``'s backward) adds in another order
    than one of the same values laid out dense, so only the strides of the forward
    give the gradient to the bit. On the device it takes its span again while in
    use, as it did when saved."""

    __slots__ = ("count", "shape", "stride", "host_stride", "span")

    def __init__(self, t: torch.Tensor) -> None:
        span = storage_span(t)
        self.shape = t.shape
        self.stride = t.stride()
        if span <= t.numel():
            self.count, self.host_stride, self.span = span, self.stride, True
        else:
            self.count, self.host_stride, self.span = t.numel(), dense_strides(t.shape, self.stride), False

    def nbytes(self, t: torch.Tensor) -> int:
        return self.count * t.element_size()

    def back_nbytes(self, element_size: int) -> int:
        """The bytes of the storage :meth:`back` makes on the device: what moved, or,
        for a tensor with gaps, the span of its strides again (the gaps included)."""
        if self.span:
            return self.count * element_size
        span = 1
        for n, st in zip(self.shape, self.stride):
            if n == 0:
                return 0
            span += (n - 1) * st  # (a broadcast dimension, stride 0, adds nothing)
        return span * element_size

    def host_view(self, buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The ``count`` elements of ``buffer`` (bytes) that hold ``t``."""
        return buffer[: self.nbytes(t)].view(t.dtype)

    def source(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(what to copy from, (shape, strides) of the host view)``: the span of
        ``t``'s storage, or ``t`` itself copied into a dense view of its layout."""
        if self.span:
            return t.as_strided((self.count,), (1,), t.storage_offset()), None
        return t, (self.shape, self.host_stride)

    def back(self, host: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        """A new tensor on ``device`` with the values of ``host`` (the ``count``
        elements :meth:`source` filled) and the shape and strides of the tensor that
        was saved, at version 0 as that of ``to(copy=True)``."""
        if self.span:
            return host.to(device, copy=True, non_blocking=non_blocking).as_strided(self.shape, self.stride)
        src = host.as_strided(self.shape, self.host_stride)
        # a broadcast dimension (stride 0) is written once and expanded again
        sizes = [1 if st == 0 else n for n, st in zip(self.shape, self.stride)]
        broadcast = sizes != list(self.shape)
        if broadcast:
            src = src[tuple(slice(0, n) for n in sizes)]
        out = torch.empty_strided(sizes, self.stride, dtype=host.dtype, device=device)
        out.copy_(src, non_blocking=non_blocking)
        set_version_counters((out,), (0,))  # (copy_ counted one write)
        return out.expand(self.shape) if broadcast else out


def storage_span(t: torch.Tensor) -> int:
    """How many storage elements ``t`` spans, from its first to its last."""
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        span += (size - 1) * abs(stride)
    return span


def dense_strides(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a tensor of ``shape`` without gaps whose dimensions lie in memory
    in the order of ``strides``: the layout torch gives ``clone()`` or
    ``empty_like`` of such a tensor (its ``infer_dense_strides``). Dimensions are
    ordered innermost first by stride, a larger size outer where strides tie; a
    broadcast dimension (stride 0) is not compared, so it keeps its place as in a
    contiguous tensor."""
    n = len(shape)
    perm = list(range(n - 1, -1, -1))  # innermost first, as a contiguous tensor has it

    def after(d0: int, d1: int) -> int:  # > 0: d0 lies outside d1
        s0, s1 = strides[d0], strides[d1]
        if s0 == 0 or s1 == 0:
            return 0
        if s0 != s1:
            return 1 if s0 > s1 else -1
        return 1 if shape[d0] > shape[d1] else 0

    for i in range(1, n):  # a stable insertion sort, as torch's
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = after(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    out, step = [0] * n, 1
    for d in perm:
        out[d] = step
        step *= max(shape[d], 1)
    return tuple(out)


class SyncCopier:
    """Copies that are done when the call returns (CPU, or any non-CUDA device).

    A copy back is a new tensor at version 0 (``CopyLayout.back``)."""

    def to_host(self, t: torch.Tensor, host: torch.Tensor, layout: CopyLayout) -> Any:
        src, view = layout.source(t)
        (host if view is None else host.as_strided(*view)).copy_(src)
        return None

    def to_device(self, host: torch.Tensor, device: torch.device, layout: CopyLayout) -> tuple[torch.Tensor, Any]:
        return layout.back(host, device), None

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
            src, view = layout.source(t)
            (host if view is None else host.as_strided(*view)).copy_(src, non_blocking=True)
            # The allocator must not reuse t's memory before the copy has read it.
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_device(self, host: torch.Tensor, device: torch.device, layout: CopyLayout) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            out = layout.back(host, device, non_blocking=True)
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
