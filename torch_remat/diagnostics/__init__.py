"""Diagnostics: traces, memory and saved-tensors reports, named saves, allocation
sites and the OOM observer.

They observe the checkpoint engine through :mod:`torch_remat.engine.observers`
and read its records; the engine never imports them.
"""
