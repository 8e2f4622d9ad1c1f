"""A bounded pool of host buffers, reused across steps.

Pinned host memory is slow to allocate (``cudaHostAlloc`` takes a global lock and
can take milliseconds), so the offloader never allocates it per tensor: buffers
come from this pool and go back to it when the tensor they hold is no longer
needed. The pool never holds more than ``capacity_bytes``; when a request does not
fit, it first frees idle buffers of other sizes, and if that is not enough it
refuses (the offloader then keeps the tensor resident).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_GRANULE = 512  # sizes are rounded up to this, so similar tensors share buffers


class HostPool:
    """Host buffers (``uint8`` tensors) of at most ``capacity_bytes`` in total."""

    def __init__(self, capacity_bytes: int, pin_memory: bool) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"HostPool: capacity_bytes must be an int >= 0, got {capacity_bytes!r}.")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self.allocated_bytes = 0
        """Bytes of all buffers the pool holds now (idle or in use)."""
        self.in_use_bytes = 0
        self.high_water_bytes = 0
        """The largest ``allocated_bytes`` ever reached (never above the capacity)."""
        self.buffers_created = 0
        self._idle: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._addresses: set[int] = set()
        self._lock = threading.RLock()  # a handle freed by gc may give a buffer back mid-acquire

    @staticmethod
    def size_class(nbytes: int) -> int:
        return -(-nbytes // _GRANULE) * _GRANULE

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least ``nbytes``, or None when the pool cannot hold one."""
        size = self.size_class(nbytes)
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                buffer, ready = idle.pop()
                if ready is not None:
                    ready.synchronize()  # a copy out of it may still be running
            else:
                if self.allocated_bytes + size > self.capacity_bytes:
                    self._free_idle(self.allocated_bytes + size - self.capacity_bytes)
                if self.allocated_bytes + size > self.capacity_bytes:
                    return None
                buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
                if type(buffer) is torch.Tensor:  # (a fake tensor's has no address)
                    self._addresses.add(buffer.data_ptr())
                self.buffers_created += 1
                self.allocated_bytes += size
                self.high_water_bytes = max(self.high_water_bytes, self.allocated_bytes)
            self.in_use_bytes += size
            return buffer

    def release(self, buffer: torch.Tensor, ready: Any = None) -> None:
        """Give ``buffer`` back; ``ready`` (an event) marks when copies out of it end."""
        size = buffer.numel()
        with self._lock:
            self.in_use_bytes -= size
            self._idle.setdefault(size, []).append((buffer, ready))

    def _free_idle(self, needed: int) -> None:
        # Largest idle buffers first: fewest frees to make room.
        for size in sorted(self._idle, reverse=True):
            idle = self._idle[size]
            while idle and needed > 0:
                buffer, ready = idle.pop()
                if ready is not None:
                    ready.synchronize()
                if type(buffer) is torch.Tensor:
                    self._addresses.discard(buffer.data_ptr())
                self.allocated_bytes -= size
                needed -= size
            if not idle:
                del self._idle[size]
            if needed <= 0:
                return

    def addresses(self) -> frozenset[int]:
        """Data pointers of the buffers the pool holds now (idle or in use): host
        memory, which an account of device memory leaves out (on CPU both are the
        same allocator)."""
        with self._lock:
            return frozenset(self._addresses)

    def clear(self) -> None:
        """Free every idle buffer (buffers in use are freed when given back)."""
        with self._lock:
            self._free_idle(self.allocated_bytes)
