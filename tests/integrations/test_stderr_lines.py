"""Lines that ranks sharing one stderr pipe write at the same moment stay whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WRITER = textwrap.dedent(
    """
    import sys
    import time
    from torch_remat.integrations._stderr import write_line
    who, start = sys.argv[1], float(sys.argv[2])
    line = f"torch_remat train: rank {who}: interrupted by SIGTERM at step 3 of 9; " + "x" * 200
    time.sleep(max(0.0, start - time.time()))
    n = 0
    while time.time() < start + 0.3 or n < 200:  # both writers at once
        n += 1
        write_line(line)
    """
)


def _lines_from_two_writers() -> list[str]:
    """Two processes writing lines to one stderr pipe at the same time, as torchrun's
    ranks do."""
    read, write = os.pipe()
    start = time.time() + 5  # after both have imported torch_remat
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(r), str(start)], stderr=write, env=env)
        for r in (0, 1)
    ]
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as f:
        text = f.read()
    for p in procs:
        assert p.wait(timeout=120) == 0
    return text.splitlines()


def test_lines_from_two_ranks_on_one_pipe_are_never_interleaved():
    lines = _lines_from_two_writers()
    whole = [f"torch_remat train: rank {r}: interrupted by SIGTERM at step 3 of 9; " + "x" * 200 for r in (0, 1)]
    assert [line for line in lines if line not in whole] == []
    assert lines.count(whole[0]) > 100 and lines.count(whole[1]) > 100


def test_the_launchers_and_the_oom_observers_lines_go_through_write_line():
    # Python's stderr writes a print's text and its newline in two calls (it has no
    # buffer), which is how two ranks' lines interleaved; the rank-level messages of
    # the launcher and of the OOM observer must use write_line.
    import inspect

    import launch.train as train
    from torch_remat.integrations import oom

    for fn in (train.usage_error, train.rank_error, train.main, oom._warn):
        source = inspect.getsource(fn)
        assert "write_line(" in source and "file=sys.stderr" not in source, fn.__name__
