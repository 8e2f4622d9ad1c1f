"""Reproducible measurements of torch_remat against no AC, torch.utils.checkpoint and
SAC. Run ``python benchmarks/run.py`` (see docs/benchmarks.md)."""
