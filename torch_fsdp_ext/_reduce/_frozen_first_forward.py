"""The part for a group whose first forward ran with every parameter frozen, trained after unfreezing."""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet


class FrozenFirstForward:
    """Resolves the original and reduce dtypes of a group that had no trainable parameter at its lazy init.

    Note: up to 2.13 ``_init_mp_dtypes`` reads both dtypes from the trainable parameters
    only, and leaves None for a group without any; after unfreezing, ``foreach_reduce``
    then reduces in the compute dtype and assigns a bf16 gradient to an fp32 parameter.
    2.14 (pytorch#187376) falls back to the group's floating-point parameters when their
    original and reduce dtypes are each uniform. ``post_backward`` passes the group's
    dtypes to ``foreach_reduce`` and reads them nowhere else, so this part resolves them
    there, from the parameters being reduced: only where the original dtype came as None,
    a check of one argument for every other group.
    """

    name = "frozen first forward"
    summary = "a group whose first forward ran frozen reduces in its reduce dtype once unfrozen"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False

    def needed(self) -> tuple[bool | None, str]:
        positions = _compat_reduce.foreach_reduce_argument_positions()
        if positions is not None and "orig_dtype" not in positions:
            # Note: 2.15 dropped the argument this part resolves, after 2.14 fixed the failure
            # (pytorch#187376); a release in that form needs no probe of ``_init_mp_dtypes``.
            return False, "foreach_reduce takes no orig_dtype: the form of releases after pytorch#187376"
        drops = _compat_reduce.probe_frozen_first_forward_drops_reduce_dtype()
        if drops is None or (drops and positions is None):
            return None, "cannot tell how this torch resolves a frozen group's reduce dtype (its probe did not run)"
        if drops:
            return True, "pytorch#186998"
        return False, "_init_mp_dtypes resolves a frozen group's reduce dtype from its parameters (pytorch#187376)"

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("fsdp_param_group_module.foreach_reduce",))

    def install(self, patches: PatchSet) -> None:
        # Note [One reduce wrapper]: the fix wraps foreach_reduce once for its parts.
        self.active = True


def group_dtypes(fsdp_params: list[Any]) -> tuple[torch.dtype, torch.dtype | None] | None:
    """(original dtype, reduce dtype) of the floating-point parameters when each is uniform, else None."""
    floating = [p for p in fsdp_params if p.orig_dtype.is_floating_point]
    orig_dtypes = {p.orig_dtype for p in floating}
    reduce_dtypes = {p.reduce_dtype for p in floating}
    if len(orig_dtypes) != 1 or len(reduce_dtypes) != 1:
        return None
    return next(iter(orig_dtypes)), next(iter(reduce_dtypes))


def with_group_dtypes(args: tuple, kwargs: dict[str, Any], orig_at: int, reduce_at: int) -> tuple:
    """``foreach_reduce``'s arguments with the group's resolved original and reduce dtypes, where they resolve:
    the positional ones returned, the keyword ones set in ``kwargs``."""
    resolved = group_dtypes(args[0] if args else kwargs["fsdp_params"])
    if resolved is None:
        return args
    args = list(args)
    for at, name, dtype in ((orig_at, "orig_dtype", resolved[0]), (reduce_at, "reduce_dtype", resolved[1])):
        if len(args) > at:
            args[at] = dtype
        else:
            kwargs[name] = dtype
    return tuple(args)
