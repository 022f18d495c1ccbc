"""The TP all-reduce of a DTensor gradient in ``reduce_dtype`` (pytorch#190626).

Under FSDP2 + tensor parallel, a TP-replicated parameter (a ``SequenceParallel`` norm
weight, a router) gets a ``Partial`` gradient; FSDP redistributes it to ``Replicate``
(an all-reduce over the TP mesh) before its reduce-scatter, in the gradient's dtype. With
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` that all-reduce ran in bf16
up to 2.14, silently: contributions 1.0 and 2**-10 sum to 1.0, not 1.0009765625. As 2.15
does (it gives the unsharded parameter ``grad_dtype=reduce_dtype``), the gradient is cast
to ``reduce_dtype`` before the redistribute; gradients reduced over data parallel only
keep their dtype until FSDP's copy-in, as 2.15 defers their upcast too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _compat
from .._patching import PatchSet, wraps


class TPAllReduceInReduceDtype:
    """A part of the ``reduce`` fix: the non-data-parallel reduction of a DTensor gradient in ``reduce_dtype``."""

    name = "tp_all_reduce"
    summary = "a TP-replicated parameter's gradient is all-reduced over the TP mesh in reduce_dtype"

    def needed(self) -> tuple[bool | None, str]:
        dtype, why = _compat.probe_tp_grad_reduce_dtype()
        if dtype is None:
            return None, f"torch's internals changed ({why}); the TP all-reduce part stands aside"
        if dtype == torch.float32:
            return False, "this torch all-reduces a TP-replicated parameter's gradient in reduce_dtype"
        return True, (
            "this torch all-reduces a TP-replicated parameter's gradient in param_dtype, not reduce_dtype "
            "(pytorch#190626)"
        )

    def wrapped_symbols(self) -> list[str]:
        module = _compat.load_internals().fsdp_param_group_module
        return [_compat.tp_reduce_symbol_name(), f"{module.__name__}.foreach_reduce"]

    def install(self, patches: PatchSet) -> None:
        internals = _compat.load_internals()
        patches.wrap(internals.FSDPParam, _compat.TP_REDUCE_METHOD[1], wrap_grad_inner_tensor)
        patches.wrap(internals.fsdp_param_group_module, "foreach_reduce", wrap_foreach_reduce)


def wrap_grad_inner_tensor(original: Callable) -> Callable:
    @wraps(original)
    def _get_grad_inner_tensor(fsdp_param: Any, grad: torch.Tensor) -> torch.Tensor:
        # Note: a plain tensor (no tensor parallel) goes straight through. The cast keeps the
        # DTensor's placements (``Partial`` stays ``Partial``), so the redistribute that follows
        # reduces in ``reduce_dtype``; bf16 -> fp32 is exact: each rank contributes what it did.
        if type(grad) is not torch.Tensor:
            reduce_dtype = fsdp_param.reduce_dtype
            if reduce_dtype not in (None, grad.dtype) and _compat.reduces_outside_dp(fsdp_param, grad):
                grad = grad.to(reduce_dtype)
        return original(fsdp_param, grad)

    return _get_grad_inner_tensor


def wrap_foreach_reduce(original: Callable) -> Callable:
    @wraps(original)
    def foreach_reduce(fsdp_params: list, unsharded_grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        # Note: up to 2.14 one group's gradients must share a dtype; a TP-reduced gradient now
        # has ``reduce_dtype`` next to ``param_dtype`` ones. Those are cast to ``reduce_dtype``
        # here, which FSDP's copy-in into its ``reduce_dtype`` buffer would do (2.15 casts in
        # its copy-in): the same values. The list owns the gradients, so it is changed in place.
        if len({grad.dtype for grad in unsharded_grads}) > 1:
            unsharded_grads[:] = [
                grad if param.reduce_dtype in (None, grad.dtype) else grad.to(param.reduce_dtype)
                for param, grad in zip(fsdp_params, unsharded_grads)
            ]
        return original(fsdp_params, unsharded_grads, *args, **kwargs)

    return foreach_reduce
