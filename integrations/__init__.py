"""torch_remat.integrations: adapters that put torch_remat under distributed
training (FSDP2, DDP, tensor parallel) and training frameworks.

Adapters use only the public API of :mod:`torch_remat`.
"""

__all__: list[str] = []
