"""Run the torch_remat benchmarks: ``python benchmarks/run.py [--quick] [--only W1,W3]``.

Prints one table per workload and the issue's targets, and writes everything as
JSON to ``benchmarks/results/`` (git-ignored). ``--quick`` runs every workload at a
tiny size and asserts the exact byte, FLOP and gradient relations (it never times
anything); its exit status is 1 when one of them does not come out as expected. A
full run reports missed targets but always exits 0: it is a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Before torch is imported: the profiler logs every start/stop at kineto's USDT level
# (5); 6 keeps those lines out of the tables.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
if not __package__:
    # Run as a script: make the benchmarks package importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import (  # noqa: E402
    w1_gpt_stack,
    w2_overhead,
    w3_sqrt_chain,
    w4_distributed,
    w5_compiled,
    w6_planner,
    w7_scale,
)
from benchmarks.report import WorkloadResult  # noqa: E402

WORKLOADS: dict[str, Callable[[bool], WorkloadResult]] = {
    "W1": w1_gpt_stack.run,
    "W1-long": w1_gpt_stack.run_long,
    "W2": w2_overhead.run,
    "W3": w3_sqrt_chain.run,
    "W4": w4_distributed.run,
    "W5": w5_compiled.run,
    "W6": w6_planner.run,
    "W7": w7_scale.run,
}
RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, object]:
    return {
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, assert relations, no timing"
    )
    parser.add_argument("--only", default="", help="comma-separated workloads, e.g. W1,W3")
    parser.add_argument("--json", type=Path, default=None, help="where to write the JSON results")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")

    threads = torch.get_num_threads()
    results = []
    for name in names:
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        try:
            result = WORKLOADS[name](args.quick)
        finally:
            torch.set_num_threads(threads)
        result.seconds = time.perf_counter() - t0
        result.load_average = (load_before, os.getloadavg()[0])
        results.append(result)
        print(result.format(), end="\n\n", flush=True)

    unexpected = [(r.name, c) for r in results for c in r.checks if not c.ok()]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.json or RESULTS / f"{'quick' if args.quick else 'full'}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": " ".join(["python benchmarks/run.py", *(argv or sys.argv[1:])]),
                "quick": args.quick,
                "machine": machine(),
                "workloads": [r.to_json() for r in results],
            },
            indent=2,
            default=str,
        )
    )
    print(f"results written to {out}")
    for name, c in unexpected:
        print(
            f"{'FAILED' if args.quick else 'target not met'} {name}: {c.format()}", file=sys.stderr
        )
    return 1 if args.quick and unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
