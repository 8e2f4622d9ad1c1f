"""``torchrun`` as launch/run.sh starts it, but for a usage error.

launch/train.py checks its arguments on every rank and exits with status 2 on a
bad one, printing why on rank 0 (a bad --remat, an unwritable --checkpoint-dir, a
budget no plan fits). torchrun would follow that with its failure report and a
traceback of its own; here the launch ends with status 2 and the worker's message
alone. Any other failure is reported as torchrun reports it.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

USAGE_ERROR = 2

if __name__ == "__main__":
    try:
        main()
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if failure.exitcode != USAGE_ERROR:
            raise
        sys.exit(USAGE_ERROR)
