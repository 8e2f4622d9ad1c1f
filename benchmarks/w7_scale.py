"""W7: the cross-rank memory report and the OOM merge at 64, 256 and 1,024 ranks.

Ranks are simulated as threads of this process, each with its own ``TCPStore``
client connected to one real ``TCPStore`` server, and each calls
``reports.gather_over_store`` -- the transport ``gather_memory_report`` uses on a
process group's store. Every rank's record comes from one real saved-tensors report
(a stack of MLP blocks under ``apply_remat`` with SAVE Linears), with a few ranks
made uneven so the report has outliers to show.

Per world size: the gathering rank's time when every rank calls at once, and when
the others have already sent (its own cost); the bytes sent to and read from the
store by all ranks; the gathering rank's peak Python memory (``tracemalloc``, while
only it runs); the lines of the text report; and the time until a rank that never
calls is named. The peer is the previous design: one key per rank holding that
rank's full report, waited for, read and deleted one by one. The OOM merge reads a
folder of generated dumps (one per rank, each written as ``oom.install`` writes
them) and reports its time, peak memory and lines.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torch_remat as remat
from benchmarks.report import Check, Table, WorkloadResult
from torch_remat.integrations import (
    RematConfig,
    _oom_bound,
    _oom_dump,
    _oom_merge,
    apply_remat,
    oom,
)
from torch_remat.integrations import reports as cluster_reports

FULL_RANKS = (64, 256, 1024)
QUICK_RANKS = (16, 64)
MISSING_TIMEOUT_S = 2.0
CONNECTIONS = 32
REPEATS = 5
"""Times are the median of this many gatherings."""


class CountingStore:
    """A store client that counts the bytes it sends and receives."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.sent, self.received = store, 0, 0

    def set(self, key: str, value: bytes | str) -> None:
        self.sent += len(value)
        self.store.set(key, value)

    def append(self, key: str, value: str) -> None:
        self.sent += len(value)
        self.store.append(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        self.received += len(value)
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)


class MLPStack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def real_report(layers: int = 8, width: int = 64) -> tuple[dict[str, Any], str]:
    """One rank's ``saved_tensors_report(loss)`` as ``to_dict()`` and as text, for a
    stack of MLP blocks with remat, each Linear a SAVE region."""
    torch.manual_seed(0)
    model = MLPStack(layers, width)
    apply_remat(model, check_fn=lambda m: isinstance(m, nn.Sequential), remat=RematConfig(save_modules=nn.Linear))
    loss = model(torch.randn(16, width)).sum()
    report = remat.saved_tensors_report(loss)
    loss.backward()
    return report.to_dict(), report.format()


def uneven_summaries(base: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` ranks holding ``base``, except three: one holds twice the first region,
    two others a quarter more in the second."""
    out = []
    heavy, uneven = n // 2 + 5, (3, n - 100 if n > 200 else n - 1)
    for rank in range(n):
        regions = [list(r) for r in base["regions"]]
        extra = 0
        if rank == heavy:
            extra, regions[0][1] = regions[0][1], regions[0][1] * 2
        elif rank in uneven:
            extra = regions[1][1] // 4
            regions[1][1] += extra
        out.append({"total": base["total"] + extra, "regions": regions})
    return out


def _key_per_rank(store: Any, ranks: list[int], rank: int, dst: int, full: dict[str, Any],
                  *, tag: str, timeout: float) -> list[dict[str, Any]] | None:
    """The previous design, for comparison: one key per rank with its full report."""
    prefix = f"peer/{tag}/"
    store.set(prefix + str(rank), json.dumps(full).encode())
    if rank != dst:
        return None
    keys = [prefix + str(r) for r in ranks]
    for key in keys:
        store.wait([key], datetime.timedelta(seconds=timeout))
    reports = [json.loads(store.get(k)) for k in keys]
    for key in keys:
        store.delete_key(key)
    return [cluster_reports.rank_summary(r) for r in reports]


class SimulatedCluster:
    """``n`` ranks as threads, each with a ``CountingStore`` of one TCPStore server."""

    def __init__(self, n: int) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # A connection takes about 0.1 s to open here, so ranks share up to CONNECTIONS clients
        # (a TCPStore client serialises its calls); the gathering rank has its own.
        connections = [
            dist.TCPStore("127.0.0.1", self.server.port, is_master=False)
            for _ in range(min(max(1, n // 8), CONNECTIONS))
        ]
        gatherer = dist.TCPStore("127.0.0.1", self.server.port, is_master=False)
        self.clients = [CountingStore(gatherer)]
        self.clients += [CountingStore(connections[r % len(connections)]) for r in range(1, n)]
        self.ranks = list(range(n))

    def bytes_through_store(self) -> int:
        total = sum(c.sent + c.received for c in self.clients)
        for c in self.clients:
            c.sent = c.received = 0
        return total

    def run(self, call: Callable[..., Any], payloads: list[Any], *, tag: str, timeout: float,
            others_first: bool, skip: tuple[int, ...] = (), traced: bool = False) -> tuple[Any, float, int]:
        """Every rank but ``skip`` calls ``call``; rank 0 gathers. Returns rank 0's
        result (or exception), its seconds, and its peak traced bytes (others_first)."""
        def rank_call(rank: int) -> Any:
            return call(self.clients[rank], self.ranks, rank, 0, payloads[rank], tag=tag, timeout=timeout)

        others = [threading.Thread(target=rank_call, args=(r,)) for r in self.ranks[1:] if r not in skip]
        start = threading.Barrier(len(others) + 1)
        if others_first:
            for t in others:
                t.start()
            for t in others:
                t.join()
        else:
            for t in others:
                t.run = (lambda f: (lambda: (start.wait(), f())))(t.run)
                t.start()
            start.wait()
        if others_first and traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        try:
            result: Any = rank_call(0)
        except cluster_reports.MemoryReportTimeout as e:
            result = e
        seconds = time.perf_counter() - t0
        peak = 0
        if others_first and traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        for t in others:
            t.join()
        return result, seconds, peak


def gather(store: Any, ranks: list[int], rank: int, dst: int, summary: dict[str, Any],
           *, tag: str, timeout: float) -> cluster_reports.ClusterMemoryReport | None:
    """What ``gather_memory_report`` does once the rank's summary is built."""
    summaries = cluster_reports.gather_over_store(store, ranks, rank, dst, summary, tag=tag, timeout=timeout)
    return None if summaries is None else cluster_reports.ClusterMemoryReport(ranks, summaries)


def measure_gather(n: int, full: dict[str, Any], *, peer: bool) -> dict[str, Any]:
    summaries = uneven_summaries(cluster_reports.rank_summary(full), n)
    cluster = SimulatedCluster(n)
    out: dict[str, Any] = {"ranks": n}
    out["gather_s_all"] = statistics.median(
        cluster.run(gather, summaries, tag=f"all{i}", timeout=60, others_first=False)[1] for i in range(REPEATS))
    cluster.bytes_through_store()
    report, _, _ = cluster.run(gather, summaries, tag="dst", timeout=60, others_first=True)
    out["store_bytes"] = cluster.bytes_through_store()
    out["gather_s_dst"] = statistics.median(
        cluster.run(gather, summaries, tag=f"dst{i}", timeout=60, others_first=True)[1] for i in range(REPEATS))
    assert report.rank_summaries == summaries, "the gathered records differ from the ones sent"
    _, _, out["dst_peak_bytes"] = cluster.run(gather, summaries, tag="mem", timeout=60, others_first=True,
                                              traced=True)
    t0 = time.perf_counter()
    out["report"] = report.format()
    out["format_s"] = time.perf_counter() - t0
    out["report_lines"] = len(out["report"].splitlines())
    out["json_ranks"] = len(report.to_dict()["totals"])
    skipped = n // 2 + 1
    error, out["missing_s"], _ = cluster.run(gather, summaries, tag="missing", timeout=MISSING_TIMEOUT_S,
                                             others_first=False, skip=(skipped,))
    out["missing_named"] = getattr(error, "missing_ranks", None) == [skipped]
    out["missing_message"] = str(error)
    if not peer:
        return out | {"peer_s_dst": None, "peer_store_bytes": None, "peer_dst_peak_bytes": None}
    fulls = [full] * n
    _, out["peer_s_all"], _ = cluster.run(_key_per_rank, fulls, tag="all", timeout=60, others_first=False)
    cluster.bytes_through_store()
    _, out["peer_s_dst"], _ = cluster.run(_key_per_rank, fulls, tag="dst", timeout=60, others_first=True)
    out["peer_store_bytes"] = cluster.bytes_through_store()
    out["peer_s_dst"] = statistics.median([out["peer_s_dst"]] + [
        cluster.run(_key_per_rank, fulls, tag=f"dst{i}", timeout=60, others_first=True)[1] for i in range(2)])
    _, _, out["peer_dst_peak_bytes"] = cluster.run(_key_per_rank, fulls, tag="mem", timeout=60,
                                                   others_first=True, traced=True)
    return out


def write_dumps(folder: str, n: int, report: dict[str, Any], text: str) -> int:
    """One OOM dump per rank of an ``n``-rank job, as ``oom.install`` writes them: every
    rank ran out at step 3 in the last block, one rank a step earlier in another. Returns
    the bytes written."""
    base = _oom_dump.new_dump("w7-job", 0, n, 3, "exception", "cpu")
    base.update(requested_bytes=2**50, requested_bytes_exact=True, site="train.py:212 allocate",
                location={"checkpoint": "layers.7", "phase": "forward", "region": None},
                error={"type": "RuntimeError", "message": "DefaultCPUAllocator: can't allocate memory",
                       "traceback": []},
                saved_tensors=report, saved_tensors_text=text, regions=_oom_dump.region_totals(report),
                largest_tensors=_oom_dump.largest_tensors(report))
    written = 0
    for rank in range(n):
        dump = dict(base, rank=rank, pid=10_000 + rank, time=base["time"] + rank * 1e-3)
        if rank == n // 2 + 5:
            dump.update(step=2, time=base["time"] - 1.0,
                        location={"checkpoint": "layers.3", "phase": "recompute", "region": "1"})
        payload = _oom_bound.encode_bounded(dump, oom.DEFAULT_MAX_DUMP_BYTES)
        _oom_dump.write_atomically(folder, f"oom_w7-job_rank{rank}_{10_000 + rank}_1.json", payload)
        written += len(payload)
    return written


def measure_merge(n: int, report: dict[str, Any], text: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out: dict[str, Any] = {"ranks": n, "dump_bytes": write_dumps(folder, n, report, text)}
        t0 = time.perf_counter()
        merged = _oom_merge.merge_dumps(folder)
        out["merge"] = merged.format()
        out["merge_s"] = time.perf_counter() - t0
        tracemalloc.start()
        _oom_merge.merge_dumps(folder).format()
        out["merge_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out["merge_lines"] = len(out["merge"].splitlines())
    out["json_dumps"] = len(merged.to_dict()["jobs"][0]["ran_out"])
    return out


def _each(name: str, sizes: list[dict[str, Any]], key: str, ok: Callable[[dict[str, Any]], bool]) -> Check:
    """A byte-exact target that must hold at every world size measured."""
    return Check(name, "bytes", ", ".join(str(size[key]) for size in sizes), all(ok(size) for size in sizes))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def run(quick: bool) -> WorkloadResult:
    sizes = QUICK_RANKS if quick else FULL_RANKS
    full, text = real_report()
    rows = [measure_gather(n, full, peer=not quick) for n in sizes]
    merges = [measure_merge(n, full, text) for n in sizes]
    table = Table(
        "W7 gather_memory_report over one TCPStore (ranks simulated as threads, one client each); "
        "peer: one key per rank with its full report",
        ["ranks", "gather ms (all at once)", "gather ms (dst only)", "store bytes", "dst peak bytes",
         "report lines", "missing rank named after s", "peer ms (dst only)", "peer store bytes",
         "peer dst peak bytes"],
        [[r["ranks"], _ms(r["gather_s_all"]), _ms(r["gather_s_dst"]), r["store_bytes"],
          r["dst_peak_bytes"], r["report_lines"], f"{r['missing_s']:.2f}", "-" if quick else _ms(r["peer_s_dst"]),
          r["peer_store_bytes"] or "-", r["peer_dst_peak_bytes"] or "-"] for r in rows],
        notes=[f"a rank that never calls: timeout {MISSING_TIMEOUT_S:g} s"],
    )
    merge_table = Table(
        "W7 OOM merge of one dump per rank (generated as oom.install writes them)",
        ["ranks", "dump bytes", "merge s", "merge peak bytes", "text lines", "dumps in --json"],
        [[m["ranks"], m["dump_bytes"], f"{m['merge_s']:.3f}", m["merge_peak_bytes"], m["merge_lines"],
          m["json_dumps"]] for m in merges],
    )
    checks = []
    per_rank = [r["store_bytes"] / r["ranks"] for r in rows]
    checks.append(Check("store bytes grow linearly with the ranks", "bytes",
                        ", ".join(f"{b:.0f} B/rank" for b in per_rank),
                        max(per_rank) - min(per_rank) <= 0.05 * min(per_rank)))
    checks += [
        _each("the text report fits a screen (<= 40 lines)", rows, "report_lines", lambda r: r["report_lines"] <= 40),
        _each("the JSON keeps every rank", rows, "json_ranks", lambda r: r["json_ranks"] == r["ranks"]),
        _each("a rank that never calls is named", rows, "missing_named", lambda r: r["missing_named"]),
        _each("the merge text fits a screen (<= 60 lines)", merges, "merge_lines", lambda m: m["merge_lines"] <= 60),
        _each("the merge --json keeps every dump", merges, "json_dumps", lambda m: m["json_dumps"] == m["ranks"]),
    ]
    peak_per_dump = [m["merge_peak_bytes"] / m["ranks"] for m in merges]
    checks.append(Check("merge memory grows linearly with the dumps", "bytes",
                        ", ".join(f"{p:.0f} B/dump" for p in peak_per_dump),
                        max(peak_per_dump) <= 1.25 * min(peak_per_dump)))
    if not quick:
        last = rows[-1]
        checks.append(Check(f"gather at {last['ranks']} ranks under 1 s", "time",
                            f"{last['gather_s_all']:.3f} s", last["gather_s_all"] < 1.0))
        checks.append(Check("a missing rank is named within the timeout + 1 s", "time",
                            f"{max(r['missing_s'] for r in rows):.2f} s",
                            all(r["missing_s"] < MISSING_TIMEOUT_S + 1.0 for r in rows)))
    return WorkloadResult(
        "W7", "cross-rank report and OOM merge at scale",
        {"ranks": list(sizes), "threads": os.cpu_count()},
        tables=[table, merge_table], checks=checks,
        data={"gather": rows, "merge": merges},
    )

