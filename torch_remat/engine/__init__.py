"""The checkpoint engine: ``remat.checkpoint``, ``remat.region`` and the recompute.

The bottom layer of torch_remat. It imports nothing from :mod:`torch_remat.scope` or
:mod:`torch_remat.diagnostics`; diagnostics follow it through the observer interface
in :mod:`torch_remat.engine.observers`. See docs/architecture.md.
"""
