import gc

import pytest
import torch

# One intra-op thread per test process: the suite runs two processes on two cores
# (scripts/test.sh), and with a thread per core each, the threads waiting for work
# spin on cores the other process needs (measured: a quarter more CPU time for the
# same tests). Tests of thread counts set their own; subprocesses keep the default.
torch.set_num_threads(1)


def _live_bytes(prof) -> int:
    return sum(e.self_cpu_memory_usage for e in prof.events())


def _peak_bytes(prof) -> int:
    # From the raw allocation records, in time order: the summary events attribute a
    # free inside a record_function range (the engine's own) to the range's start.
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


class MemoryProbe:
    """Net CPU bytes allocated (and not freed) inside a ``with`` block (``bytes``),
    and the most that were live at once (``peak``), from the profiler's memory
    events."""

    def __enter__(self):
        # Leftovers of earlier tests freed by the cycle collector mid-measurement
        # would show up as negative bytes: collect now, and not while measuring.
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if self._gc_was_enabled:
            gc.enable()
        self.bytes = _live_bytes(self._prof)
        self.peak = _peak_bytes(self._prof)
        return False


def pytest_collection_finish(session):
    # What exists now (torch, transformers, the test modules) lives to the end: move it
    # out of the cycle collector's reach, so that each gc.collect() of the memory tests
    # walks only what the tests created (collecting all of it again and again took
    # half the time of the fast tier). Frozen objects are left out of gc.get_objects().
    gc.collect()
    gc.freeze()


@pytest.fixture
def fresh_dynamo():
    """Reset Dynamo before and after a test, so no compiled code leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def memory_probe():
    return MemoryProbe


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def docs_check():
    """scripts/docs_check.py: compares the output quoted in README.md and docs/ with the
    output of the runs the tests make."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "docs_check.py"
    spec = importlib.util.spec_from_file_location("docs_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
