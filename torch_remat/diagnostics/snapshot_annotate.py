"""``remat.memory_snapshot_annotate``: label the blocks of a CUDA memory snapshot
with what torch_remat holds in them.

``torch.cuda.memory._snapshot()`` lists the caching allocator's segments and blocks
(address, size, state, allocation stack). A block that holds a tensor a checkpoint
keeps for backward gets a ``"remat"`` entry: one label per held tensor whose
storage starts inside the block, ``{"checkpoint", "region", "tensor", "nbytes"}``,
so a snapshot viewer (or a script) sees "layers.3 / attn / saved.2" instead of an
anonymous 16 MiB block.
"""

from __future__ import annotations

from typing import Any

from .alloc_sites import SnapshotIndex, cached_snapshot
from .holdings import entry_holdings
from .registry import live_entries
from .storage import storages_of


def held_storage_labels(device_type: str) -> list[tuple[int, int, dict[str, Any]]]:
    """``(device index, data_ptr, label)`` of every storage on ``device_type`` that a
    live checkpoint holds (parameters excluded), in registry order."""
    out = []
    for entry in live_entries():
        holdings = entry_holdings(entry)
        if holdings is None:
            continue
        for group in holdings.groups:
            for item in group.items:
                if item.parameter:
                    continue
                for t in item.tensors:
                    for info in storages_of(t):
                        if info.device.type != device_type:
                            continue
                        label = {
                            "checkpoint": holdings.name,
                            "region": group.region,
                            "tensor": item.name,
                            "nbytes": info.nbytes,
                        }
                        out.append((info.device.index or 0, info.data_ptr, label))
    return out


def memory_snapshot_annotate(
    snapshot: dict[str, Any] | None = None, *, device_type: str = "cuda"
) -> dict[str, Any]:
    """Label the active blocks of ``snapshot`` that hold tensors kept by checkpoints.

    ``snapshot`` is a ``torch.cuda.memory._snapshot()`` dict (None: take one now,
    or reuse the one torch_remat cached, see :func:`clear_memory_snapshot_cache`).
    Each ``active_allocated`` block holding the start of a kept tensor's storage
    gains ``block["remat"] = [{"checkpoint": ..., "region": ..., "tensor": ...,
    "nbytes": ...}, ...]``: the region's qualified name, ``(inputs)`` for kept
    checkpoint inputs or ``(state snapshots)``, and the tensor's name as the reports
    print it (``saved.0``, ``(output at idx 1)``). The dict is changed in place and
    returned. Storages are matched by data pointer on ``device_type`` devices whose
    index equals the segment's ``"device"`` (``device_type="cpu"`` matches CPU
    tensors, which is how it is tested without a GPU).
    """
    if snapshot is None:
        snapshot = cached_snapshot()[0]
    index = SnapshotIndex(snapshot)
    for device, ptr, label in held_storage_labels(device_type):
        block = index.block_at(device, ptr)
        if block is not None:
            block.setdefault("remat", []).append(label)  # type: ignore[attr-defined]
    return snapshot
