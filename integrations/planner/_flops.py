"""FLOP formulas for ops ``FlopCounterMode`` has none for, so that a recompute's
FLOPs do not depend on which kernel the planning machine dispatches to.

On CPU ``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
which torch's counter does not know (it counts 0), while the CUDA kernels of the same
call (flash, memory-efficient, cuDNN) are counted as their two matmuls. The CPU kernel
is counted the same way here: planned on CPU for a GPU, attention's recompute is seen.

The fused recurrent kernels (``nn.LSTM`` on CPU runs ``mkldnn_rnn_layer``, one per
layer and direction; cuDNN's and MIOpen's run the whole stack in one op) have no
formula either: a checkpointed LSTM's recompute counted 0. They are counted as the
matmuls of their weight matrices over every step of every sequence, as ``nn.GRU``
and ``nn.RNN`` (which run as ``mm``/``addmm`` on CPU) are counted by torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import sdpa_flop_count


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    # As torch counts the CUDA kernels: QK^T and the product with V, a causal mask
    # not discounted; grouped-query attention's K and V count as broadcast.
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _tokens(input: torch.Tensor, packed: bool) -> int:
    # the (step, sequence) pairs the recurrence runs: a packed input is
    # (sum of the batch sizes, features), a padded one (seq, batch, features) or
    # (batch, seq, features)
    return input.shape[0] if packed else input.numel() // max(input.shape[-1], 1)


def _matmuls(weights: Any, tokens: int) -> int:
    # each weight matrix (gates x inputs, gates x hidden, a projection) multiplies
    # one vector per token; biases are added, not counted (as torch's addmm)
    return sum(2 * tokens * w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2)


def _mkldnn_rnn_layer(input: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    # one layer, one direction: input-to-gates (w0) and hidden-to-gates (w1)
    return _matmuls((w0, w1), _tokens(input, False))


def _fused_rnn(batch_sizes_at: int) -> Any:
    # _cudnn_rnn / miopen_rnn: every layer's and direction's matrices in ``weight``;
    # ``batch_sizes`` (non-empty for a packed input) at position ``batch_sizes_at``
    # of the arguments after ``input`` and ``weight``
    def formula(input: torch.Tensor, weight: Any, *args: Any, **kwargs: Any) -> int:
        batch_sizes = kwargs.get("batch_sizes", args[batch_sizes_at] if len(args) > batch_sizes_at else ())
        return _matmuls(weight, _tokens(input, len(batch_sizes) != 0))

    return formula


EXTRA_FORMULAS = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
    "mkldnn_rnn_layer": _mkldnn_rnn_layer,
    "_cudnn_rnn": _fused_rnn(12),  # (input, weight, weight_stride0, weight_buf, hx, cx, ...)
    "miopen_rnn": _fused_rnn(10),  # (input, weight, weight_stride0, hx, cx, ...)
}
"""Per aten op (by name), ``formula(*args, **kwargs) -> FLOPs`` (tensors, not shapes)."""


def flops(func: Any, args: tuple, kwargs: dict, out: Any, registry: dict) -> int:
    """FLOPs of one op: torch's formula (``registry``), else one of ours, else 0."""
    formula = registry.get(func.overloadpacket)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    extra = EXTRA_FORMULAS.get(func.overloadpacket.__name__)
    return 0 if extra is None else int(extra(*args, **kwargs))
