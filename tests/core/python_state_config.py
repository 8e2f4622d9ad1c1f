"""A user's configuration module: module-level values that a checkpointed function
reads as attributes of the module (``python_state_config.SCALE``), for
tests/core/test_python_state.py."""

SCALE = 1.0
TABLE = {"k": 1.0}
