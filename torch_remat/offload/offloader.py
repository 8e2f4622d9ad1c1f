"""``ActivationOffloader``: saved-tensor hooks that move what SAVE regions keep to
host memory during the forward and bring it back, ahead of time, in backward.

It is a hook pair for ``remat.saved_tensors_hooks`` (or a checkpoint's
``saved_tensors_hooks=`` option), so it only ever sees tensors a checkpoint keeps
resident; what the checkpoint recomputes never moves.

Timeline, with ``prefetch=k``: the tensors of the checkpoint calls it is handed
are grouped by call, in forward order. A group stays on the device until the
forward has started ``k`` later calls, then its copies to the host start (on CUDA
on a side stream, overlapping the next calls' compute); so the last ``k`` groups
are still on the device when backward begins. In backward, the first unpack of
group ``n`` starts the copy back of group ``n - k``: each group's copy back is
issued while backward still has ``k`` groups to go through before it needs it.
A group whose copy back was not issued in time (an unusual backward order) is
copied synchronously on unpack, and counted.

Host memory comes from a :class:`~torch_remat.offload.pool.HostPool` of bounded
size; when it is full a tensor simply stays resident.
"""

from __future__ import annotations

import fnmatch
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import SavedTensorKind, current_saved_tensor_info
from .._autograd_hooks import VersionedTensor
from .._compat import version_of
from .copies import CopyLayout, CudaCopier, SyncCopier
from .pool import HostPool


@dataclass
class OffloadStats:
    """What the offloader did, in bytes and counts (since it was created)."""

    offloaded_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes copied to the host, by region qualified name."""
    fetched_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes copied back to the device, by region."""
    resident_small: int = 0
    """Tensors left resident because they are below ``min_bytes``."""
    resident_pool_full: int = 0
    """Tensors left resident because the pool had no room."""
    prefetches: int = 0
    sync_fetches: int = 0
    """Copies back done on unpack because no prefetch had been issued."""


@dataclass(frozen=True)
class OffloadEvent:
    """One entry of the event log (``record_events=True``).

    ``what`` is ``"offload"`` (copy to host issued), ``"prefetch"`` (copy back
    issued while backward is at group ``at``) or ``"unpack"`` (backward took a
    tensor of the group; ``at`` is the group too). ``group`` counts the checkpoint
    calls that handed the offloader tensors, in forward order."""

    what: str
    group: int
    at: int
    region: str | None = None
    nbytes: int = 0


class _Group:
    """The offloaded tensors of one checkpoint call."""

    __slots__ = ("ordinal", "handles", "offloaded", "prefetched", "unpacked")

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.handles: list[weakref.ref] = []
        self.offloaded = False
        self.prefetched = False
        self.unpacked = False

    def live(self) -> list[_Handle]:
        return [h for h in (r() for r in self.handles) if h is not None]


class _Handle:
    """What the pack hook returns for a tensor it moves."""

    __slots__ = (
        "owner", "group", "region", "device", "layout", "nbytes", "version", "tensor", "host", "buffer", "ready",
        "__weakref__",
    )

    def __init__(
        self, owner: ActivationOffloader, group: _Group, region: str | None, t: torch.Tensor, layout: CopyLayout
    ) -> None:
        self.owner = owner
        self.group = group
        self.region = region
        self.device = t.device
        self.layout = layout
        self.nbytes = layout.nbytes(t)  # what moves: the storage a broadcast view spans
        self.version = version_of(t)
        self.tensor: torch.Tensor | None = t  # on the device: before offload, or prefetched
        self.host: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.ready: Any = None  # event ending the last copy that touched the buffer

    def _remat_resident_tensors(self) -> list[torch.Tensor]:
        # What the reports count for this save: the device copy while there is one,
        # and the host buffer (not the offloader and its pool, which tensors_in
        # would otherwise walk into).
        return [t for t in (self.tensor, self.buffer) if t is not None]

    def __del__(self) -> None:
        buffer = self.buffer
        if buffer is not None:
            self.buffer = self.host = None
            try:
                self.owner.pool.release(buffer, self.ready)
            except Exception:  # interpreter shutdown: the pool may be gone already
                pass


class ActivationOffloader:
    """Offload the tensors SAVE regions save to a pool of host buffers.

    ::

        offloader = ActivationOffloader(pool_bytes=8 << 30, prefetch=2, regions=["*attn*"])
        with remat.saved_tensors_hooks(offloader.pack_hook, offloader.unpack_hook):
            loss = model(batch)
        loss.backward()

    or ``remat.checkpoint(saved_tensors_hooks=offloader)``, or
    ``apply_remat(model, saved_tensors_hooks=offloader)``.

    Args:
        pool_bytes: the most host memory the pool holds (pinned where CUDA is
            available). Buffers are reused across steps.
        prefetch: ``k``, how many checkpoint calls ahead backward copies back
            (and how many of the last calls of the forward are not offloaded).
        min_bytes: tensors smaller than this stay resident (a copy costs more
            than it saves).
        regions: glob patterns (``fnmatch``) on the region's qualified name; a
            tensor moves only if its region matches one.
        kinds: which kept tensors move (default: SAVE-region saves only; add
            ``SavedTensorKind.SAVE_OUTPUT``/``CHECKPOINT_INPUT`` for the others).
        checkpoints: glob patterns on the checkpoint's ``region_name`` (under
            ``apply_remat``, the block's qualified name); a tensor moves only if
            its checkpoint matches one (a planner's offload plan moves the tensors
            of some blocks and not of others).
        record_events: keep an event log (:attr:`events`), for tests and tuning.

    Parameters (and views of them) are never moved. Without CUDA the same path
    runs with synchronous copies into the pool.
    """

    def __init__(
        self,
        pool_bytes: int,
        *,
        prefetch: int = 1,
        min_bytes: int = 1 << 20,
        regions: Iterable[str] = ("*",),
        kinds: Iterable[SavedTensorKind] = (SavedTensorKind.BACKWARD,),
        checkpoints: Iterable[str] = ("*",),
        pin_memory: bool | None = None,
        record_events: bool = False,
    ) -> None:
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"ActivationOffloader: prefetch must be an int >= 0, got {prefetch!r}.")
        if isinstance(regions, str):
            regions = (regions,)
        self.regions = tuple(regions)
        if isinstance(checkpoints, str):
            checkpoints = (checkpoints,)
        self.checkpoints = tuple(checkpoints)
        self._some_checkpoints = self.checkpoints != ("*",)
        self.kinds = frozenset(kinds)
        self.prefetch = prefetch
        self.min_bytes = min_bytes
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.pool = HostPool(pool_bytes, pin)
        self.stats = OffloadStats()
        self.events: list[OffloadEvent] | None = [] if record_events else None
        self._groups: dict[int, _Group] = {}
        self._last_call: Any = object()
        self._ordinal = -1
        self._copiers: dict[torch.device, Any] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- hooks

    def pack_hook(self, t: torch.Tensor) -> Any:
        info = current_saved_tensor_info()
        kind = SavedTensorKind.BACKWARD if info is None else info.kind
        region = None if info is None else info.region
        if kind not in self.kinds or (info is not None and info.is_parameter):
            return _resident(t, info)
        if not any(fnmatch.fnmatchcase(region or "", p) for p in self.regions):
            return _resident(t, info)
        if self._some_checkpoints and not any(
            fnmatch.fnmatchcase((info.checkpoint if info is not None else None) or "", p)
            for p in self.checkpoints
        ):
            return _resident(t, info)
        layout = CopyLayout(t)
        if layout.nbytes(t) < self.min_bytes:
            self.stats.resident_small += 1
            return _resident(t, info)
        with self._lock:
            group = self._group_for(None if info is None else info.call)
            handle = _Handle(self, group, region, t, layout)
            group.handles.append(weakref.ref(handle))
            self._offload_due(handle)
        return handle

    def unpack_hook(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed.unpack() if type(packed) is VersionedTensor else packed
        with self._lock:
            group = packed.group
            if not group.unpacked:
                group.unpacked = True
                self._prefetch_before(group.ordinal)
            t = packed.tensor
            if t is None:
                self.stats.sync_fetches += 1
                t = self._fetch(packed)
            elif packed.host is not None:
                packed.tensor = None  # prefetched: autograd owns it from here
            self._log("unpack", group.ordinal, group.ordinal, packed.region, packed.nbytes)
        self._copier(packed.device).wait(packed.ready, t)
        return t

    # ------------------------------------------------------------ the timeline

    def _group_for(self, call: Any) -> _Group:
        if call != self._last_call or self._ordinal < 0:
            self._last_call = call
            self._ordinal += 1
            self._prune()
            self._groups[self._ordinal] = _Group(self._ordinal)
        return self._groups[self._ordinal]

    def _prune(self) -> None:
        for ordinal in [o for o, g in self._groups.items() if not g.live()]:
            del self._groups[ordinal]

    def _offload_due(self, handle: _Handle) -> None:
        """Start the copies to host of the groups ``prefetch`` calls behind (with
        ``prefetch=0``, of ``handle`` itself)."""
        if self.prefetch == 0:
            handle.group.offloaded = True
            self._offload(handle)
            return
        for ordinal, group in list(self._groups.items()):
            if ordinal <= self._ordinal - self.prefetch and not group.offloaded:
                group.offloaded = True
                for live in group.live():
                    self._offload(live)

    def _offload(self, handle: _Handle) -> None:
        t = handle.tensor
        if version_of(t) != handle.version:
            # Updated in place since it was saved: a copy would hide that from
            # backward, which must refuse it; it stays on the device as it is.
            return
        buffer = self.pool.acquire(handle.nbytes)
        if buffer is None:
            self.stats.resident_pool_full += 1
            return  # stays on the device
        host = handle.layout.host_view(buffer, t)
        handle.ready = self._copier(handle.device).to_host(t, host, handle.layout)
        handle.buffer, handle.host, handle.tensor = buffer, host, None
        region = handle.region or ""
        self.stats.offloaded_bytes[region] = self.stats.offloaded_bytes.get(region, 0) + handle.nbytes
        self._log("offload", handle.group.ordinal, self._ordinal, handle.region, handle.nbytes)

    def _prefetch_before(self, ordinal: int) -> None:
        """Backward reached group ``ordinal``: copy back the group ``prefetch`` before
        it (and any group in between still on the host)."""
        if self.prefetch == 0:
            return
        for target in range(max(ordinal - self.prefetch, 0), ordinal):
            group = self._groups.get(target)
            if group is None or group.prefetched or not group.offloaded:
                continue
            group.prefetched = True
            for handle in group.live():
                if handle.host is not None and handle.tensor is None:
                    handle.tensor = self._fetch(handle)
                    self.stats.prefetches += 1
                    self._log("prefetch", target, ordinal, handle.region, handle.nbytes)

    def _fetch(self, handle: _Handle) -> torch.Tensor:
        t, handle.ready = self._copier(handle.device).to_device(handle.host, handle.device, handle.layout)
        region = handle.region or ""
        self.stats.fetched_bytes[region] = self.stats.fetched_bytes.get(region, 0) + handle.nbytes
        return t

    def _copier(self, device: torch.device) -> Any:
        copier = self._copiers.get(device)
        if copier is None:
            copier = CudaCopier(device) if device.type == "cuda" else SyncCopier()
            self._copiers[device] = copier
        return copier

    def _log(self, what: str, group: int, at: int, region: str | None, nbytes: int) -> None:
        if self.events is not None:
            self.events.append(OffloadEvent(what, group, at, region, nbytes))

    # ---------------------------------------------------------------- state

    def held_tensors(self) -> int:
        """Tensors the offloader still holds (on the host or the device)."""
        with self._lock:
            return sum(len(g.live()) for g in self._groups.values())


def _resident(t: torch.Tensor, info: Any) -> Any:
    """What the pack hook returns for a tensor it leaves where it is. Inside a
    checkpoint the tensor itself (the checkpoint checks its version); outside one,
    held with its version (:class:`VersionedTensor`), so that an update in place
    before backward (``optimizer.step()`` on a saved weight) is refused as
    autograd refuses it without hooks: a tensor handed back as is by a hook is
    not version-checked by autograd. Held detached (it shares the version counter):
    an op's output saved for its own backward would otherwise hold its autograd
    node, which holds the save, a cycle Python's collector cannot see."""
    return t if info is not None and info.checkpoint is not None else VersionedTensor(t.detach())
