"""A submodule with a module-level counter."""

COUNT = 0
