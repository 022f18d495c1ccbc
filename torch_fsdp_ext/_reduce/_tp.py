"""The TP all-reduce of a DTensor gradient in ``reduce_dtype`` (pytorch#190626).

Under FSDP2 + tensor parallel, a TP-replicated parameter (a ``SequenceParallel`` norm
weight, a router) gets a ``Partial`` gradient; FSDP redistributes it to ``Replicate``
(an all-reduce over the TP mesh) before its reduce-scatter, in the gradient's dtype. With
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` that all-reduce ran in bf16
up to 2.14, silently: contributions 1.0 and 2**-10 sum to 1.0, not 1.0009765625. As 2.15
does (it gives the unsharded parameter ``grad_dtype=reduce_dtype``), the gradient is cast
to ``reduce_dtype`` before the redistribute; gradients reduced over data parallel only
keep their dtype until FSDP's copy-in, as 2.15 defers their upcast too. A group then holds
gradients of two dtypes, which ``foreach_reduce`` up to 2.14 refuses: the mixed-gradient part
(``_grad_dtypes``) brings them to ``reduce_dtype``, as 2.15's copy-in does (``_fix`` installs it
with this part).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet, wraps


class TPAllReduceInReduceDtype:
    """A part of the ``reduce`` fix: the non-data-parallel reduction of a DTensor gradient in ``reduce_dtype``."""

    name = "TP all-reduce"
    summary = "a TP-replicated parameter's gradient is all-reduced over the TP mesh in reduce_dtype"

    def __init__(self) -> None:
        self.active = False

    def needed(self) -> tuple[bool | None, str]:
        dtype, why = _compat_reduce.probe_tp_grad_reduce_dtype()
        if dtype is None:
            return None, f"torch's internals changed ({why}); the TP all-reduce part stands aside"
        if dtype == torch.float32:
            return False, "this torch all-reduces a TP-replicated parameter's gradient in reduce_dtype"
        return True, "in param_dtype, pytorch#190626"

    def wrapped_symbols(self) -> list[str]:
        return [_compat_reduce.tp_reduce_symbol_name()]

    def install(self, patches: PatchSet) -> None:
        internals = _compat.load_internals()
        patches.wrap(internals.FSDPParam, _compat_reduce.TP_REDUCE_METHOD[1], functools.partial(wrap_grad_inner_tensor, self))
        self.active = True


def wrap_grad_inner_tensor(part: TPAllReduceInReduceDtype, original: Callable) -> Callable:
    @wraps(original)
    def _get_grad_inner_tensor(fsdp_param: Any, grad: torch.Tensor) -> torch.Tensor:
        # Note: a plain tensor (no tensor parallel) goes straight through. The cast keeps the
        # DTensor's placements (``Partial`` stays ``Partial``), so the redistribute that follows
        # reduces in ``reduce_dtype``; bf16 -> fp32 is exact: each rank contributes what it did.
        if type(grad) is not torch.Tensor and part.active:
            reduce_dtype = fsdp_param.reduce_dtype
            if reduce_dtype not in (None, grad.dtype) and _compat_reduce.reduces_outside_dp(fsdp_param, grad):
                grad = grad.to(reduce_dtype)
        return original(fsdp_param, grad)

    return _get_grad_inner_tensor

