"""The part for a ``fully_shard`` unit that has not run forward, in a backward without gradient sync."""

from __future__ import annotations

import weakref
from typing import Any

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet


class NeverRanUnits:
    """A unit whose parameters were never all-gathered has no gradient to convert (pytorch#194058).

    Note: up to 2.14 every group's ``post_backward`` runs without sync, the units that took no
    part in the forward included (a vision tower on a text-only batch, a frozen tower, an unused
    head), and ``to_accumulated_grad_if_needed`` reads ``_unsharded_param``, which only the first
    all-gather creates: ``AttributeError`` where the parameter has a reduce dtype. 2.15 reads it
    with a guard. Each ``FSDPParam`` without an unsharded parameter gets that guard as an
    instance attribute, which the first all-gather removes (Note [Until the first all-gather]
    in ``_fix``): no cost once a unit has run.
    """

    name = "units that never ran"
    summary = "a unit that has not run forward is skipped in a backward without sync, as torch 2.15 does"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False

    def needed(self) -> tuple[bool | None, str]:
        fails = _compat_reduce.probe_no_sync_reads_missing_unsharded_param()
        if fails is None:
            return None, "cannot tell how a backward without sync treats a unit that never ran (its probe did not run)"
        if fails:
            return True, "pytorch#194058"
        return False, "this torch skips a unit that never ran in a backward without sync"

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("FSDPParamGroup.lazy_init",))

    def install(self, patches: PatchSet) -> None:
        self.active = True


def to_accumulated_grad_if_needed(fsdp_param_ref: weakref.ref) -> None:
    """An ``FSDPParam``'s ``to_accumulated_grad_if_needed`` until its first all-gather: nothing to convert."""
    fsdp_param = fsdp_param_ref()
    if "_unsharded_param" in fsdp_param.__dict__:
        type(fsdp_param).to_accumulated_grad_if_needed(fsdp_param)
