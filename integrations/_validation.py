"""``apply_remat``'s options checked where they are received, before any module is
patched, with the answers ``remat.checkpoint`` would give at the first forward."""

from __future__ import annotations

from typing import Any

import torch_remat as remat


def validate_apply_options(
    recompute_state_hooks: Any,
    rng_state_hooks: Any,
    early_stop: Any,
    determinism_check: Any,
    rebuild: Any = None,
    who: str = "apply_remat",
) -> None:
    """Check the options where they are received (by ``who``, the public function),
    before any module is patched, as remat.checkpoint would check them at the first
    forward (hooks numbered as the caller numbered them, before the RNG hooks are
    prepended)."""
    if not isinstance(rng_state_hooks, bool):
        raise TypeError(
            f"{who}: rng_state_hooks must be True or False, got {rng_state_hooks!r} "
            f"({type(rng_state_hooks).__name__})."
        )
    options: dict[str, Any] = {"recompute_state_hooks": recompute_state_hooks or ()}
    if early_stop is not None:
        options["early_stop"] = early_stop
    if determinism_check is not None:
        options["determinism_check"] = determinism_check
    if rebuild is not None:
        options["rebuild"] = rebuild
    try:
        remat.checkpoint(**options)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("remat.checkpoint:", f"{who}:", 1)) from None
