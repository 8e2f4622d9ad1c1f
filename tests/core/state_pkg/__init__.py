"""A user's package whose submodule holds a counter (``state_pkg.sub.COUNT``), for
tests/core/test_python_state.py."""

from . import sub  # noqa: F401
