"""``torchrun`` as launch/run.sh starts it, but for a usage error.

launch/train.py checks its arguments on every rank and exits with status 2 on a
bad one, printing why on rank 0 (a bad --remat, an unwritable --checkpoint-dir, a
budget no plan fits). torchrun would follow that with its failure report and a
traceback of its own; here the launch ends with status 2 and the worker's message
alone (torchrun's lines about ending the other workers and about the failed one
are left out). So does a checkpoint save the system refused (a full disk), with
status 3 and one line per rank. SIGINT (Ctrl-C) or SIGTERM to the launch ends it with
the conventional status (130, 143), each worker saying in one line where it was
stopped and which checkpoint a restart resumes from (torchrun's traceback and its
notices that it stops the workers are left out). Any other failure is reported as
torchrun reports it, but for its notice that it ends the other workers.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

USAGE_ERROR = 2
SAVE_FAILED = 3
"""A checkpoint the system refused to write (a full disk): each rank said why."""
REPORTED = (USAGE_ERROR, SAVE_FAILED)


class _UsageErrorLines(logging.Filter):
    """torchrun's own log lines around a worker's usage error: its notice that it
    ends the other workers, and its report of the failed one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "closing signal" not in message and not any(f"(exitcode: {c})" in message for c in REPORTED)


class _SignalLines(logging.Filter):
    """torchrun's notice that a signal made it stop the workers (each says so)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal, shutting down workers" not in record.getMessage()


if __name__ == "__main__":
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_UsageErrorLines())
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_SignalLines())
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if failure.exitcode not in REPORTED:
            raise
        sys.exit(failure.exitcode)
