"""One line to stderr in one ``write``.

Python's ``sys.stderr`` writes straight through to the file descriptor, and
``print(text, file=sys.stderr)`` writes the text and its newline in two calls. The
ranks of a job launched by torchrun share one stderr pipe, so two ranks printing
at the same moment can interleave ("...resumes from ittorch_remat train: rank 1...")
and a reader counting lines miscounts them. A line written with :func:`write_line`
is one ``os.write``: a pipe never splits a write of up to ``PIPE_BUF`` bytes (4096 on
Linux), so lines of that length from different ranks stay whole.
"""

from __future__ import annotations

import io
import os
import sys


def write_line(text: str) -> None:
    """Write ``text`` and a newline to ``sys.stderr`` as one write where it has a file
    descriptor (under pytest's capture, or any stream without one, it is printed)."""
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        print(text, file=stream, flush=True)
        return
    stream.flush()
    data = (text + "\n").encode(stream.encoding or "utf-8", "backslashreplace")
    while data:
        written = os.write(fd, data)
        data = data[written:]
