"""A user's module whose name starts with ``torch`` (not torch's): a class with a
class-level counter, for tests/core/test_python_state.py."""

import torch


class Counted:
    calls = 0

    def scale(self):
        type(self).calls += 1
        return 1.0 + 0.25 * type(self).calls

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.scale()
