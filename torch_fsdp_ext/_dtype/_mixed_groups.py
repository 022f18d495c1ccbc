"""Groups that keep mixed dtypes: ``dtype_strategy="preserve"``, and per-parameter compute dtypes.

FSDP's own ``_init_mp_dtypes`` sets each parameter's dtype attributes; on releases
whose reduce-scatter casts the whole output to one dtype (up to 2.14), the reduce
path is wrapped so that each parameter gets its gradient in its own dtype, as 2.15
does natively.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from .. import _compat
from .._compat import _dtype as _compat_dtype
from .._patching import wraps, wraps_over

# Set on each FSDPParam of a mixed group (releases without per-parameter gradient dtypes):
# (the parameter's own dtype, the group's reduce dtype or None, the dtype its reduced
# gradient is rounded through before the cast to its own dtype, or None).
_MIXED_GROUP_ATTR = "_torch_fsdp_ext_mixed_dtypes"


def init_mp_dtypes_of_mixed_group(init_mp_dtypes: Callable, group: Any) -> None:
    """Run FSDP's ``_init_mp_dtypes`` on a group that keeps mixed trainable dtypes.

    Note: FSDP's own code sets every per-parameter dtype attribute; only its
    uniform-dtype assertion must not see the trainable parameters, which it
    skips for a group without any. ``requires_grad`` is restored right after,
    before any autograd graph can record it.
    """
    trainable = [p.sharded_param for p in group.fsdp_params if p.sharded_param.requires_grad]
    for param in trainable:
        param.requires_grad_(False)
    try:
        init_mp_dtypes(group)
    finally:
        for param in trainable:
            param.requires_grad_(True)
    if _compat_dtype.probe_reduce_casts_grads_per_param():
        return
    # Note: FSDP stores ``reduce_dtype=None`` when it equals ``param_dtype`` (one dtype needs no
    # cast), which for a mixed group would mean "the promoted dtype": read the user's policy.
    trainable_params = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
    reduce_dtypes = {_compat.param_mp_policy(group, p).reduce_dtype for p in trainable_params}
    if len(reduce_dtypes) > 1:
        raise AssertionError(f"FSDP expects uniform reduce dtype but got {reduce_dtypes}")
    reduce_dtype = next(iter(reduce_dtypes), None)
    for fsdp_param in group.fsdp_params:
        if reduce_dtype is None and fsdp_param.param_dtype is not None:
            # Note: without reduce_dtype, micro-batches without sync accumulate in the compute dtype
            # (autograd adds into the unsharded bf16 grad); as 2.15 does, a parameter computed in
            # another dtype than its own accumulates in its own (FSDP's reduce-dtype accumulation path).
            fsdp_param.reduce_dtype = fsdp_param.orig_dtype
        fsdp_param.__dict__[_MIXED_GROUP_ATTR] = (fsdp_param.orig_dtype, reduce_dtype, None)


def is_mixed_group(group: Any) -> bool:
    return any(_MIXED_GROUP_ATTR in p.__dict__ for p in group.fsdp_params)


def mark_mixed_compute_group(
    group: Any, reduce_dtype: torch.dtype | None, round_through: dict[Any, torch.dtype]
) -> None:
    """Reduce a group of one original dtype whose gradients come in several compute dtypes.

    ``reduce_dtype``: the policy's (None: the widest gradient dtype). ``round_through``:
    FSDPParam -> the dtype its reduced gradient is rounded to first, which makes one
    reduce in the widest dtype give what a reduce in that dtype gives.
    """
    for fsdp_param in group.fsdp_params:
        fsdp_param.__dict__[_MIXED_GROUP_ATTR] = (fsdp_param.orig_dtype, reduce_dtype, round_through.get(fsdp_param))


def forget_mixed_group(group: Any) -> None:
    for fsdp_param in group.fsdp_params:
        fsdp_param.__dict__.pop(_MIXED_GROUP_ATTR, None)


def _foreign_reduce_message(where: str, fn: Any, what: str) -> str:
    return (
        f"torch_fsdp_ext: {where}.foreach_reduce is {_compat.describe_function(fn)}, another library's patch, "
        f"{what}; the gradients of FSDP2 groups that keep mixed dtypes (dtype_strategy='preserve', per-parameter "
        "compute dtypes) would be reduced through one dtype and drift silently, so torch_fsdp_ext refuses. Apply "
        "that library's patch before the model's first forward (the plugin then reduces these groups with torch's "
        "own function), or train with dtype_strategy='upcast'."
    )


def wrap_reduce_for_mixed_groups(patches: Any) -> None:
    """Reduce a mixed group's gradients in one dtype and cast each back to its parameter's dtype.

    Note: ``foreach_reduce`` gets the group's reduce dtype (or the promoted dtype of
    its parameters, as 2.15 reduces) and no output dtype, so the reduce output keeps the reduce
    dtype; ``to_sharded_dtensor``, which wraps each parameter's slice of it as
    the new ``.grad``, then casts the slice to the parameter's dtype. Gradient
    accumulation adds the slice in place into the existing ``.grad``, which
    keeps its dtype. Groups that are not mixed pass straight through.

    Note: another library's wrapper of ``foreach_reduce`` (Note [Foreign patches] in
    ``_compat``). One already in place is left to the other groups; a mixed group is
    reduced with torch's own function, found behind it, so it reduces bit for bit as
    without the wrapper (whose job, one gradient dtype, the plugin has done). One put in
    place after the plugin's drops it: each mixed parameter's gradient checks, before it
    is assigned, that the plugin's wrapper is still the one FSDP calls, and refuses.
    """
    internals = _compat.load_internals()
    module = internals.fsdp_param_group_module
    where = module.__name__

    def wrap_foreach_reduce(original: Callable) -> Callable:
        torch_reduce = _compat.torch_own(original, "foreach_reduce")
        if torch_reduce is None:
            raise RuntimeError(_foreign_reduce_message(where, original, "which hides torch's own function"))
        signature = inspect.signature(torch_reduce)

        @wraps(original)
        def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
            fsdp_params = args[0] if args else kwargs["fsdp_params"]
            mixed = fsdp_params[0].__dict__.get(_MIXED_GROUP_ATTR) if fsdp_params else None
            if mixed is None:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            grads = bound.arguments["unsharded_grads"]
            # As torch 2.15 does: without reduce_dtype, reduce in the promoted dtype of the parameters.
            reduce_dtype = mixed[1] or functools.reduce(
                torch.promote_types, {p.__dict__[_MIXED_GROUP_ATTR][0] for p in fsdp_params}
            )
            if len({g.dtype for g in grads}) > 1:
                grads[:] = [g.to(reduce_dtype) for g in grads]  # the list owns the gradients
            bound.arguments["orig_dtype"] = None
            bound.arguments["reduce_dtype"] = reduce_dtype
            return torch_reduce(*bound.args, **bound.kwargs)

        return foreach_reduce

    patches.wrap(module, "foreach_reduce", wrap_foreach_reduce)
    ours = module.foreach_reduce

    def wrap_to_sharded_dtensor(original: Callable) -> Callable:
        @wraps(original)
        def to_sharded_dtensor(fsdp_param: Any, tensor: torch.Tensor) -> Any:
            mixed = fsdp_param.__dict__.get(_MIXED_GROUP_ATTR)
            if mixed is not None and module.foreach_reduce is not ours and not wraps_over(module.foreach_reduce, ours):
                raise RuntimeError(_foreign_reduce_message(
                    where, module.foreach_reduce, "put in place after the plugin's wrapper, which it dropped"
                ))
            if mixed is not None and mixed[2] is not None:
                tensor = tensor.to(mixed[2])
            if mixed is not None and tensor.dtype != mixed[0]:
                tensor = tensor.to(mixed[0])
            return original(fsdp_param, tensor)

        return to_sharded_dtensor

    patches.wrap(internals.FSDPParam, "to_sharded_dtensor", wrap_to_sharded_dtensor)
