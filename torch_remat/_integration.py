"""The one internal module ``torch_remat.integrations`` may import besides the
public API: helpers the adapters share with the core's reports, which are not part
of the public surface."""

from .diagnostics.format import format_bytes

__all__ = ["format_bytes"]
