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
notices that it stops the workers are left out). So does SIGINT or SIGTERM to one
worker alone (``kill`` of one rank's process): that worker says where it stopped,
exits with the same status, torchrun stops the others, which say so too, and the
launch ends with that status. Any other failure (a worker killed outright, by
SIGKILL say, reports a negative exit code) is reported as torchrun reports it, but
for its notice that it ends the other workers.
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

USAGE_ERROR = 2
SAVE_FAILED = 3
"""A checkpoint the system refused to write (a full disk): each rank said why."""
INTERRUPTED = (128 + signal.SIGINT, 128 + signal.SIGTERM)
"""SIGINT or SIGTERM reached a worker, which said in one line where it stopped."""
REPORTED = (USAGE_ERROR, SAVE_FAILED, *INTERRUPTED)


class _UsageErrorLines(logging.Filter):
    """torchrun's own log lines around a failure a worker reported itself (a usage
    error, a refused save, an interruption): its notice that it ends the other
    workers, and its report of the failed one."""

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
