"""``torch_remat.offload``: move what SAVE regions keep to host memory and back.

:class:`ActivationOffloader` is a saved-tensor hook pair for
``remat.saved_tensors_hooks`` / ``remat.checkpoint(saved_tensors_hooks=...)`` that
copies SAVE-region saves into a bounded pool of (pinned) host buffers during the
forward and prefetches them back in backward, ``prefetch`` checkpoints ahead. See
docs/api/hooks.md.
"""

from .offloader import ActivationOffloader, OffloadEvent, OffloadStats
from .pool import HostPool

__all__ = ["ActivationOffloader", "OffloadEvent", "OffloadStats", "HostPool"]
