"""Damage done to a checkpoint's files by the launcher's tests."""

from __future__ import annotations

import pathlib
import struct


def flip_a_byte_of_tensor_data(path: pathlib.Path) -> None:
    """Flip one bit in the middle of the largest tensor's data in a .distcp file (each
    tensor there is a torch.save archive whose data is the stored entry .../data/0):
    the file keeps its size and still loads, with another value in that tensor."""
    raw = bytearray(path.read_bytes())
    entries, pos = [], 0
    while (pos := raw.find(b"PK\x03\x04", pos)) >= 0:
        name_len, extra_len = struct.unpack_from("<HH", raw, pos + 26)
        start = pos + 30 + name_len + extra_len
        if raw[pos + 30 : pos + 30 + name_len].endswith(b"/data/0"):
            entries.append((raw.find(b"PK\x07\x08", start) - start, start))
        pos += 4
    size, start = max(entries)
    raw[start + size // 2] ^= 0x01
    path.write_bytes(bytes(raw))
