"""The part for gradients of two dtypes in one reduce: accumulated ones in the reduce dtype, fresh ones
(or unused parameters' zero placeholders) in the compute dtype."""

from __future__ import annotations

import torch

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet


class MixedGradDtypes:
    """Brings every gradient of a group to its reduce dtype before ``foreach_reduce`` copies them in.

    Note: torch 2.15 casts each gradient into the reduce-dtype buffer during the copy-in
    (``chunk_cat_mixed_dtype``); widening the compute dtype (bf16, fp16) to the reduce
    dtype (fp32) is exact, so casting first and copying a uniform list reduces bit for bit
    as 2.15 does. A group whose gradients already share one dtype (every step without
    accumulation, every uniform accumulation) costs one set of dtypes and nothing else.
    """

    name = "mixed gradient dtypes"
    summary = "accumulated fp32 and fresh bf16 gradients (or unused-parameter zeros) in one reduce"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False

    def needed(self) -> tuple[bool | None, str]:
        rejects = _compat_reduce.probe_reduce_rejects_mixed_grad_dtypes()
        if rejects is None:
            return None, "cannot tell whether foreach_reduce accepts gradients of two dtypes (its probe did not run)"
        if rejects:
            return True, "pytorch#196996"
        return False, "foreach_reduce brings gradients of several dtypes to the reduce dtype itself"

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("fsdp_param_group_module.foreach_reduce",))

    def install(self, patches: PatchSet) -> None:
        # Note [One reduce wrapper]: the fix wraps foreach_reduce once for its parts.
        self.active = True


def to_reduce_dtype(grads: list[torch.Tensor], reduce_dtype: torch.dtype) -> None:
    """Cast a group's gradients of several dtypes to ``reduce_dtype``, in the list FSDP reduces."""
    grads[:] = [grad.to(reduce_dtype) for grad in grads]  # the list owns the gradients
