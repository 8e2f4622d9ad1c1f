"""The benchmarks' quick mode: every workload at a tiny size, with the exact byte and
FLOP relations of the benchmark issue asserted (never times).

``python benchmarks/run.py --quick`` runs once, in a subprocess, for the module; each
test reads one part of its JSON output. W4 starts two gloo ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import plugin_env

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "run.py"
WORKLOADS = ["W1", "W1-long", "W2", "W3", "W4", "W5", "W6", "W7"]
QUICK_TIMEOUT_S = 720  # W5 compiles five modes, W7 simulates 64 ranks
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory, pytestconfig):
    out = tmp_path_factory.mktemp("benchmarks") / "quick.json"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--json", str(out)],
        cwd=ROOT,
        env=plugin_env(pytestconfig),
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    results = json.loads(out.read_text()) if out.exists() else None
    return proc, results


def _workload(quick, name: str) -> dict:
    proc, results = quick
    assert results is not None, f"no results written:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    by_name = {w["name"]: w for w in results["workloads"]}
    assert name in by_name, f"workload {name} did not run"
    return by_name[name]


def test_quick_mode_exits_cleanly(quick):
    proc, _ = quick
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def test_quick_mode_never_times(quick):
    _, results = quick
    assert results is not None and results["quick"]
    for w in results["workloads"]:
        assert not [c for c in w["checks"] if c["kind"] == "time"], w["name"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_byte_and_flop_relations_hold(quick, name):
    w = _workload(quick, name)
    if w["skipped"]:
        pytest.skip(w["skipped"])
    assert w["checks"], f"{name} checked nothing"
    failed = [c for c in w["checks"] if c["met"] != (c["known_miss"] is None)]
    assert not failed, "\n".join(f"{c['name']}: {c['measured']}" for c in failed)


def test_save_regions_hold_no_more_bytes_than_sac_with_the_same_save_set(quick):
    # SAVE regions keep only what the replay cannot rebuild, so each SAVE-region
    # mode holds at most the bytes of the SAC mode that saves the same matmuls.
    checks = {c["name"]: c for c in _workload(quick, "W1")["checks"]}
    for remat_mode, sac_mode in (
        ("remat save linears", "SAC mm/addmm"),
        ("remat save matmuls", "SAC mm/addmm/bmm"),
    ):
        c = checks[f"{remat_mode} holds no more bytes than {sac_mode} (same save set)"]
        assert c["met"] and c["known_miss"] is None, c["measured"]


@pytest.mark.parametrize("name", ["W1", "W1-long"])
def test_megatron_style_with_rebuild_always_holds_proj_input_less_for_the_av_flops(quick, name):
    checks = {c["name"]: c for c in _workload(quick, name)["checks"]}
    rebuilt = [c for n, c in checks.items() if n.startswith("Megatron-style with rebuild='always'")]
    flops = [c for n, c in checks.items() if "rebuild always recomputes no linear" in n]
    assert len(rebuilt) == 1 and len(flops) == 1
    for c in rebuilt + flops:
        assert c["met"] and c["known_miss"] is None, c["measured"]


@pytest.mark.slow
def test_the_docs_quote_the_quick_w5_table(quick, docs_check):
    lines = quick[0].stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode ") and "eager live after fwd" in line)
    docs_check.check("benchmarks-w5-quick", "\n".join(lines[start : start + 7]) + "\n")


@pytest.mark.slow
def test_the_docs_quote_the_quick_w6_output(quick, docs_check):
    lines = quick[0].stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("W6 planner on the W1 stack"))
    targets = lines.index("targets:", start)
    end = next(i for i in range(targets, len(lines)) if not lines[i].strip())
    docs_check.check("benchmarks-w6-quick", "\n".join(lines[start:end]) + "\n")


def test_hf_overhead_quick_mode_runs_with_exact_gradients(pytestconfig):
    # benchmarks/hf_overhead.py exits 1 where either checkpointed mode's gradients
    # differ from the plain model's; its times are printed, never asserted
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hf_overhead.py"), "--quick"],
        cwd=ROOT, env=plugin_env(pytestconfig), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "apply_remat / transformers checkpointing" in proc.stdout
    assert "module-state capture per layer call: walked" in proc.stdout
