"""What the ``dtype`` fix does with a group whose trainable parameters mix dtypes.

One small class per strategy, each with the same two steps:

- ``before_sharding``: in ``FSDPParamGroup.__init__``, on plain parameters;
- ``at_lazy_init``: right before ``_init_mp_dtypes`` (first forward), on the
  sharded parameters. Returns True when the group goes on with mixed dtypes,
  which the fix then lets through FSDP's uniform-dtype check.

Note: ``upcast`` keeps fp32 master weights (the classic mixed-precision recipe:
``MixedPrecisionPolicy.param_dtype`` still casts for compute); ``preserve``
trains every parameter in the dtype it was loaded in, as single-device training
would, at half the training-state memory for bf16 parameters; ``error`` casts
nothing and names every parameter.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import torch.distributed as dist

from . import _compat
from ._dtype_plan import GroupDtypePlan, MixedParamDtypeError, ParamEntry, describe_mixed_dtypes, format_dtype

logger = logging.getLogger("torch_fsdp_ext")

_KEEP_APART_HINT = (
    "Fix: parameters that must not be cast need one dtype per group: freeze them "
    "(requires_grad_(False)), give them their own fully_shard group, or pass them in ignored_params."
)


class UpcastCost:
    """What ``upcast`` added in this process, so that its memory cost is never silent.

    Note: the first upcast logs one WARNING (on rank 0 only: every rank upcasts the
    same parameters), naming how to keep the loaded dtypes; each group is logged at
    INFO. The totals are in ``status()``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.params = 0
        self.bytes = 0  # of master weights on this rank's shards
        self._warned = False

    def add(self, group_name: str, params: int, added_bytes: int, widest: str) -> None:
        with self._lock:
            self.params += params
            self.bytes += added_bytes
            first, self._warned = not self._warned, True
        if first and (not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(
                "torch_fsdp_ext: dtype_strategy='upcast' turned %d trainable parameter(s) of FSDP2 group %s into "
                "%s master weights: +%s bytes on this rank, about 4x that with their gradients and Adam state. "
                "Other mixed groups are upcast too (each logged at INFO on the 'torch_fsdp_ext' logger; totals in "
                "torch_fsdp_ext.status()). To keep every parameter in its loaded dtype instead: "
                "TORCH_FSDP_EXT_DTYPE_STRATEGY=preserve or torch_fsdp_ext.install(dtype_strategy='preserve').",
                params, group_name, widest, f"{added_bytes:,}",
            )


UPCAST_COST: UpcastCost = globals().get("UPCAST_COST") or UpcastCost()


class UpcastStrategy:
    """fp32 master weights: the narrower trainable floating params are upcast to the group's widest dtype."""

    name = "upcast"

    def before_sharding(self, plan: GroupDtypePlan, group_name: str, mp_policy: Any) -> list[tuple[ParamEntry, int]]:
        """Upcast before sharding; returns each upcast entry with the bytes it adds per element."""
        if not plan.is_mixed or self._conflicts(plan):
            return []  # nothing to do, or an error that lazy init reports with full FQNs
        added = plan.added_bytes(lambda p: p.tensor.numel())
        self._report(group_name, plan, mp_policy.param_dtype is None, f"{added} bytes before sharding")
        casts = [(p, plan.widest.itemsize - p.tensor.dtype.itemsize) for p in plan.narrower()]
        for p, _ in casts:
            p.handle.data = p.handle.data.to(plan.widest)
        return casts

    def at_lazy_init(self, group: Any, plan: GroupDtypePlan, group_name: str) -> bool:
        conflicts = self._conflicts(plan)
        if conflicts:
            raise MixedParamDtypeError(describe_mixed_dtypes(group_name, plan, conflicts, _KEEP_APART_HINT))
        casts = plan.narrower()
        added = plan.added_bytes(lambda p: _compat.local_shard_numel(p.handle))
        computes_in_widest = any(_compat.param_mp_policy(group, p.handle).param_dtype is None for p in casts)
        self._report(group_name, plan, computes_in_widest, f"{added} bytes on this rank's shards")
        for p in casts:
            _compat.change_sharded_param_dtype(p.handle, plan.widest)
        UPCAST_COST.add(group_name, len(casts), added, format_dtype(plan.widest))
        return False

    @staticmethod
    def _conflicts(plan: GroupDtypePlan) -> dict[int, str]:
        return {id(p): f"must not be cast: {why}" for p, why in plan.keep_dtype if p.tensor.dtype != plan.widest}

    @staticmethod
    def _report(group_name: str, plan: GroupDtypePlan, computes_in_widest: bool, added: str) -> None:
        casts = ", ".join(f"{p.name} ({format_dtype(p.tensor.dtype)})" for p in plan.narrower())
        widest = format_dtype(plan.widest)
        logger.info(
            "torch_fsdp_ext: upcast %d trainable parameter(s) of FSDP2 group %s to %s for uniform "
            "fp32 master weights (+%s): %s",
            len(plan.narrower()), group_name, widest, added, casts,
        )
        if computes_in_widest:
            warnings.warn(
                f"torch_fsdp_ext: FSDP2 group {group_name} has no MixedPrecisionPolicy.param_dtype, so the "
                f"parameters upcast to {widest} now also compute in {widest}: {casts}. Pass "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) to keep "
                "low-precision compute with fp32 master weights, or install(dtype_strategy='preserve') to "
                "keep every parameter in its own dtype.",
                stacklevel=3,
            )


class PreserveStrategy:
    """Native mixed groups: every parameter, gradient and optimizer state keeps its own dtype.

    Gradients of the group are reduced in one dtype (``reduce_dtype`` when set,
    else the promoted dtype of the parameters, whose dtypes the gradients follow)
    and each parameter receives its gradient cast to its own dtype after the
    reduce-scatter (``_compat``).
    """

    name = "preserve"

    def before_sharding(self, plan: GroupDtypePlan, group_name: str, mp_policy: Any) -> list:
        return []  # nothing is cast

    def at_lazy_init(self, group: Any, plan: GroupDtypePlan, group_name: str) -> bool:
        if plan.keep_dtype:
            # Their gradients are not plain floating tensors of their own dtype: no cast back is defined.
            why_not = {id(p): f"cannot be reduced with other dtypes: {why}" for p, why in plan.keep_dtype}
            raise MixedParamDtypeError(describe_mixed_dtypes(group_name, plan, why_not, _KEEP_APART_HINT))
        dtypes = ", ".join(
            f"{format_dtype(d)}: {sum(p.tensor.dtype == d for p in plan.trainable)}"
            for d in sorted({p.tensor.dtype for p in plan.trainable}, key=str)
        )
        logger.info("torch_fsdp_ext: FSDP2 group %s keeps mixed parameter dtypes (%s)", group_name, dtypes)
        return True


class ErrorStrategy:
    """Cast nothing; replace FSDP's assertion with an error naming every parameter."""

    name = "error"
    _hint = (
        "Fix: install the plugin with dtype_strategy='upcast' to keep fp32 master weights or "
        "dtype_strategy='preserve' to train each parameter in its own dtype, or cast these parameters to one "
        "dtype before fully_shard (e.g. model.float()), or freeze them (requires_grad_(False))."
    )

    def before_sharding(self, plan: GroupDtypePlan, group_name: str, mp_policy: Any) -> list:
        return []

    def at_lazy_init(self, group: Any, plan: GroupDtypePlan, group_name: str) -> bool:
        why_not = {id(p): f"must not be cast: {why}" for p, why in plan.keep_dtype}
        raise MixedParamDtypeError(describe_mixed_dtypes(group_name, plan, why_not, self._hint))


STRATEGY_CLASSES = {cls.name: cls for cls in (UpcastStrategy, PreserveStrategy, ErrorStrategy)}
STRATEGIES = tuple(STRATEGY_CLASSES)


def make_strategy(name: str) -> UpcastStrategy | PreserveStrategy | ErrorStrategy:
    try:
        return STRATEGY_CLASSES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"dtype_strategy must be one of {STRATEGIES}, got {name!r}") from None
