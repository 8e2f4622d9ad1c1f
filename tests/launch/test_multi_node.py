"""launch/run.sh on two nodes: two torchrun agents on this machine (--nnodes 2, one
rank each) meet in a c10d rendezvous on a free 127.0.0.1 port, train launch/train.py
(FSDP2, selective remat) to the end and print the cross-rank memory report."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from helpers import plugin_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "4"]
TIMEOUT_S = 240
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_env(port: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_REMAT_NO_SETUP="1",
               LOGLEVEL="INFO", KINETO_LOG_LEVEL="6")
    env.update(NNODES="2", NPROC="1", RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="multi-node-test",
               LOCAL_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture(scope="module")
def two_nodes(pytestconfig):
    env = plugin_env(pytestconfig, agent_env(free_loopback_port()))
    command = ["bash", str(ROOT / "launch" / "run.sh"), *SMALL, "--steps", "3"]
    agents = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=TIMEOUT_S) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return [(agent.returncode, out, err) for agent, (out, err) in zip(agents, outputs)]


def test_both_agents_finish(two_nodes):
    for code, out, err in two_nodes:
        assert code == 0, out[-3000:] + err[-3000:]


def test_rendezvous_gives_each_agent_one_node_of_two(two_nodes):
    # torchrun's agent logs the rendezvous result, one field a line: its node
    # (group) rank and the global ranks of its workers
    found = set()
    for _, _, err in two_nodes:
        fields = ("group_rank", "group_world_size", "global_ranks", "global_world_sizes")
        values = [re.search(rf"\b{f}=(\S+)", err) for f in fields]
        assert all(values), err[-3000:]
        found.add(tuple(v.group(1) for v in values))
    assert found == {("0", "2", "[0]", "[2]"), ("1", "2", "[1]", "[2]")}


def test_workers_meet_on_the_loopback_address(two_nodes):
    for _, _, err in two_nodes:
        assert "master_addr=127.0.0.1" in err, err[-3000:]


def test_first_node_trains_to_the_end_and_prints_the_cross_rank_report(two_nodes):
    first = next(out for _, out, _ in two_nodes if "torch_remat train:" in out)
    assert "parallel=fsdp2 remat=selective ranks=2" in first
    assert "step    3/3" in first
    assert re.search(r"torch_remat memory across 2 ranks: saved for backward .* in total, .* on every rank", first)
    assert "balanced: no rank or region differs by more than 10%" in first


def test_second_node_prints_nothing_of_rank_0(two_nodes):
    outs = sorted(out for _, out, _ in two_nodes)
    assert sum("torch_remat train:" in out for out in outs) == 1


@pytest.mark.slow
def test_the_docs_transcript_shows_what_the_first_node_prints(two_nodes, docs_check):
    commands = docs_check.quoted_commands("distributed-multi-node")
    assert commands[0].startswith("export NNODES=2 NPROC=1 RDZV_ENDPOINT=127.0.0.1:")
    assert [c.split("#")[0].rstrip(" &") for c in commands[1:]] == [
        " ".join(["bash launch/run.sh", *SMALL, "--steps", "3"])
    ] * 2
    first = next(out for _, out, _ in two_nodes if "torch_remat train:" in out)
    docs_check.check("distributed-multi-node", first)
