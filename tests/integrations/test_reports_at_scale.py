"""The cross-rank memory report at 64 simulated ranks: threads calling the transport
of ``gather_memory_report`` (``reports.gather_over_store``) against one real TCPStore,
the compact text, the JSON with every rank, and a rank that never calls."""

from __future__ import annotations

import json
import threading

import pytest
import torch.distributed as dist

from torch_remat.integrations import reports

WORLD = 64
KiB = 1024
CONNECTIONS = 4  # opening a TCPStore connection takes about 0.1 s; ranks share a few


class CountingStore:
    """A store client that records which calls it makes."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return counted


@pytest.fixture(scope="module")
def store_server():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    shared = [dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(CONNECTIONS)]
    gatherer = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    return server, shared, gatherer


def summaries(world=WORLD):
    """Every rank 2 MiB in layers.0 and 1 MiB in layers.1; rank 40 twice layers.0,
    ranks 3 and 17 a quarter more in layers.1."""
    out = []
    for rank in range(world):
        first = 4096 * KiB if rank == 40 else 2048 * KiB
        second = 1280 * KiB if rank in (3, 17) else 1024 * KiB
        regions = [["layers.0", first, 1], ["layers.1", second, 1], [reports.OUTSIDE_REGIONS, 512, 2]]
        out.append({"total": first + second + 512, "regions": regions})
    return out


def gather(store_server, records, *, tag, skip=(), timeout=30.0, world=WORLD, others_first=False):
    """Every rank but ``skip`` sends its record in its own thread; rank 0 gathers (at
    the same time, or after the others have sent). Returns rank 0's result (or the
    exception it raised) and its store client."""
    _, shared, gatherer = store_server
    ranks = list(range(world))
    dst_store = CountingStore(gatherer)

    def send(rank):
        reports.gather_over_store(shared[rank % CONNECTIONS], ranks, rank, 0, records[rank],
                                  tag=tag, timeout=timeout)

    threads = [threading.Thread(target=send, args=(r,)) for r in ranks[1:] if r not in skip]
    for t in threads:
        t.start()
        if others_first:
            t.join()
    try:
        result = reports.gather_over_store(dst_store, ranks, 0, 0, records[0], tag=tag, timeout=timeout)
    except reports.MemoryReportTimeout as e:
        result = e
    for t in threads:
        t.join()
    return result, dst_store


def test_gathering_rank_receives_every_ranks_record_in_rank_order(store_server):
    records = summaries()
    result, _ = gather(store_server, records, tag="order")
    assert result == records


def test_gathering_leaves_no_key_in_the_store(store_server):
    server = store_server[0]
    before = server.num_keys()
    gather(store_server, summaries(), tag="keys")
    assert server.num_keys() == before


def test_gathering_rank_makes_the_same_store_calls_at_8_and_64_ranks(store_server):
    _, few = gather(store_server, summaries(8), tag="calls8", world=8, others_first=True)
    _, many = gather(store_server, summaries(64), tag="calls64", world=64, others_first=True)
    # arriving last, the gathering rank also marks the gathering complete
    assert few.calls == many.calls == [
        "append", "add", "set", "wait", "get", "delete_key", "delete_key", "delete_key"]


def test_report_of_64_ranks_groups_equal_ranks_outliers_first(store_server):
    result, _ = gather(store_server, summaries(), tag="text")
    report = reports.ClusterMemoryReport(list(range(WORLD)), result)
    assert report.format() == """\
torch_remat memory across 64 ranks: saved for backward 194.53 MiB in total; per rank min 3.00 MiB, median 3.00 MiB, max 5.00 MiB (rank 40)

per rank, equal totals grouped (outliers first):
  5.00 MiB  rank 40
  3.25 MiB  ranks 3, 17
  3.00 MiB  ranks 0-2, 4-16, 18-39, 41-63 (61 ranks)

per region (bytes by rank under each uneven region, outliers first):
  region                  min    median       max  most on
  layers.0           2.00 MiB  2.00 MiB  4.00 MiB  rank 40      ! 50% spread
      4.00 MiB  rank 40
      2.00 MiB  ranks 0-39, 41-63 (63 ranks)
  layers.1           1.00 MiB  1.00 MiB  1.25 MiB  ranks 3, 17  ! 20% spread
      1.25 MiB  ranks 3, 17
      1.00 MiB  ranks 0-2, 4-16, 18-63 (62 ranks)
  (outside regions)     512 B     512 B     512 B  all ranks

imbalance: totals differ by 40.0% of the max (over 10% flagged); regions over 10%: layers.0, layers.1"""


def test_many_distinct_values_are_summed_up_in_one_line():
    records = [{"total": 1000 + rank, "regions": [["layers.0", 1000 + rank, 1]]} for rank in range(WORLD)]
    text = reports.ClusterMemoryReport(list(range(WORLD)), records).format()
    per_rank = text.split("\n\n")[1].splitlines()
    assert per_rank == [
        "per rank, equal totals grouped (outliers first):",
        "  1.04 KiB  rank 63",
        "    1000 B  rank 0",
        "       ...  61 other values on 61 ranks, 1001 B to 1.04 KiB",
        "  1.01 KiB  rank 31",
    ]


def test_json_keeps_every_ranks_bytes(store_server):
    result, _ = gather(store_server, summaries(), tag="json")
    data = json.loads(reports.ClusterMemoryReport(list(range(WORLD)), result).to_json())
    assert data["totals"] == [r["total"] for r in summaries()]
    layer0 = data["regions"][0]
    assert layer0["name"] == "layers.0"
    assert layer0["bytes_per_rank"] == [r["regions"][0][1] for r in summaries()]
    assert (layer0["max_rank"], layer0["top_ranks"]) == (40, [40, 0, 1])


def test_a_rank_that_never_calls_is_named_after_the_timeout(store_server):
    error, _ = gather(store_server, summaries(), tag="missing", skip=(41,), timeout=1.0)
    assert isinstance(error, reports.MemoryReportTimeout)
    assert error.missing_ranks == [41]
    assert str(error).startswith(
        "gather_memory_report: rank 41 did not send their memory report within 1 s "
        "(tag 'missing'; arrived: ranks 0-40, 42-63 (63 ranks)). Every rank of the group"
    )


def test_rank_summary_sums_the_calls_of_one_checkpoint_name():
    report = {
        "total_bytes": 700, "outside_bytes": 100,
        "checkpoints": [{"name": "layers.0", "bytes": 200}, {"name": "layers.1", "bytes": 100},
                        {"name": "layers.0", "bytes": 300}],
        "outside": [{"node": "MulBackward0"}],
    }
    assert reports.rank_summary(report) == {
        "total": 700,
        "regions": [["layers.0", 500, 2], ["layers.1", 100, 1], [reports.OUTSIDE_REGIONS, 100, 1]],
    }


def test_a_rank_sending_twice_under_one_tag_does_not_stand_in_for_a_missing_rank(store_server):
    _, shared, gatherer = store_server
    records = summaries(4)
    reports.gather_over_store(shared[0], [0, 1, 2, 3], 1, 0, records[1], tag="twice", timeout=5)
    reports.gather_over_store(shared[0], [0, 1, 2, 3], 1, 0, records[1], tag="twice", timeout=5)
    reports.gather_over_store(shared[0], [0, 1, 2, 3], 2, 0, records[2], tag="twice", timeout=5)
    with pytest.raises(reports.MemoryReportTimeout) as caught:
        reports.gather_over_store(gatherer, [0, 1, 2, 3], 0, 0, records[0], tag="twice", timeout=5)
    assert caught.value.missing_ranks == [3]
    assert "(tag 'twice'; arrived: ranks 0-2 (3 ranks); rank 1 sent twice under this tag)" in str(caught.value)
