"""The part that gives each unsharded gradient the dtype torch 2.15 gives it (pytorch#197203)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet

# Note [Gradients born in the reduce dtype]: up to 2.14 autograd produces an unsharded
# parameter's gradient in the compute dtype (bf16) and FSDP upcasts it to ``reduce_dtype``
# later, in several places that each had a failure of their own: accumulation without sync
# (a gradient first seen on the synchronizing micro-batch meets upcast ones: pytorch#196996),
# unused parameters' zero placeholders (the same assertion), a group frozen at its first
# forward (#186998), the TP all-reduce of a replicated parameter's gradient, run in bf16
# (#190626). 2.15 sets ``grad_dtype`` on the unsharded parameter instead (#197203), so
# autograd casts each gradient once, as it makes it: a weight whose gradient autograd sums
# over a broadcast (a norm weight) is then summed in fp32 rather than rounded to bf16 first,
# and every later step sees gradients of one dtype. This part sets the same attribute, once
# per parameter, when its unsharded parameter is created; the failures above then do not arise.
# 2.15 also defers the upcast of a fresh gradient on the synchronizing backward to the
# reduce-scatter's copy-in (``_set_unsharded_grad_dtypes``): widening is exact, so the values
# are the same, but the gradient lives in fp32 from its birth here (docs/performance.md).

# Set on an ``FSDPParam`` whose original parameter carried a ``grad_dtype`` other than its dtype
# (pytorch#170648): ``fully_shard`` replaces the parameter, which loses it before 2.15.
USER_GRAD_DTYPE_ATTR = "_torch_fsdp_ext_user_grad_dtype"


def unsharded_grad_dtype(fsdp_param: Any) -> torch.dtype | None:
    """The gradient dtype of ``fsdp_param``'s unsharded parameter, as 2.15 chooses it; None: the compute dtype.

    ``reduce_dtype`` first, then a ``grad_dtype`` the user set before ``fully_shard``. Where
    neither is set, 2.15 takes the original dtype; a release before keeps the compute dtype,
    and so does this part (a working script is not silently made to accumulate and reduce twice
    the bytes): the dtype fix sets ``reduce_dtype`` on the masters it makes, and
    ``install(reduce_dtype=torch.float32)`` on every group that asks.
    """
    if not fsdp_param.orig_dtype.is_floating_point:
        return None
    return fsdp_param.reduce_dtype or fsdp_param.__dict__.get(USER_GRAD_DTYPE_ATTR)


def needed_before_197203(unknown: str, fixed: str, cause: str) -> tuple[bool | None, str]:
    """A part's ``needed()`` for a change that pytorch#197203 made: by the gradient dtype torch gives a new
    unsharded parameter (``unknown``: what cannot be told; ``fixed``: why not needed; ``cause``: why needed)."""
    dtype, why = _compat_reduce.probe_unsharded_grad_dtype()
    if dtype is None:
        return None, f"cannot tell {unknown} ({why})"
    if dtype == torch.float32:
        return False, fixed
    return True, cause


def give_grad_dtype(fsdp_param: Any, unsharded: torch.Tensor) -> None:
    dtype = unsharded_grad_dtype(fsdp_param)
    if dtype is not None and unsharded.grad_dtype != dtype:
        unsharded.grad_dtype = dtype


def forget_grad_dtype(unsharded: torch.Tensor) -> None:
    """What a release before 2.15 leaves on an unsharded parameter: gradients in its own dtype.

    Note: a gradient accumulated in another dtype (``uninstall()`` between micro-batches) is kept,
    and autograd may not constrain the dtype then (``grad_dtype=None``): later gradients add into it
    as into torch's own upcast accumulation.
    """
    if unsharded.grad_dtype == unsharded.dtype:
        return
    grad = unsharded.grad
    unsharded.grad_dtype = unsharded.dtype if grad is None or grad.dtype == unsharded.dtype else None


class GradDtypeAtBirth:
    """Each unsharded parameter's ``grad_dtype``, and unused parameters' zero placeholders in it."""

    name = "gradients in reduce_dtype"
    summary = "unsharded gradients are born in reduce_dtype (pytorch#197203), as torch 2.15 makes them"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False

    def needed(self) -> tuple[bool | None, str]:
        return needed_before_197203(
            "in which dtype this torch makes unsharded gradients",
            "this torch makes unsharded gradients in reduce_dtype (pytorch#197203)", "pytorch#197203",
        )

    def wrapped_symbols(self) -> list[str]:
        names = _compat.symbol_names(self.internals, ("FSDPParamGroup.lazy_init",))
        if _compat_reduce.probe_zero_grad_dtype_follows_grad_dtype() is False:
            owner = self.internals.FSDPParam
            names.append(f"{owner.__module__}.{owner.__qualname__}.unsharded_zero_grad_data")
        return names

    def install(self, patches: PatchSet) -> None:
        if _compat_reduce.probe_zero_grad_dtype_follows_grad_dtype() is False:
            patches.wrap(self.internals.FSDPParam, "unsharded_zero_grad_data",
                         lambda found: zero_grad_data_in_grad_dtype(self, found))
        self.active = True


def zero_grad_data_in_grad_dtype(part: GradDtypeAtBirth, found: property) -> property:
    """``FSDPParam.unsharded_zero_grad_data`` making an unused parameter's zeros in its gradient dtype.

    Note: it runs only for a parameter without a gradient in a reduce with
    ``set_reduce_scatter_unused_params(True)``; zeros are zeros in any dtype, and in the
    gradient dtype they join a reduce of gradients in that dtype.
    """

    def unsharded_zero_grad_data(fsdp_param: Any) -> torch.Tensor:
        unsharded = fsdp_param.unsharded_param
        if not part.active or unsharded.grad_dtype in (None, unsharded.dtype):
            return found.fget(fsdp_param)
        return fsdp_param._get_grad_inner_tensor(torch.zeros_like(unsharded, dtype=unsharded.grad_dtype))

    return property(unsharded_zero_grad_data, doc=found.__doc__)

