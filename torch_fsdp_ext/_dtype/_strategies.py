"""What the ``dtype`` fix does with a model whose trainable parameters mix dtypes.

One small class per strategy. Each has ``at_lazy_init``: right before a group's
``_init_mp_dtypes`` (first forward), on its sharded parameters; it returns True when
the group goes on with mixed dtypes, which the fix then lets through FSDP's
uniform-dtype check. ``upcast`` also decides once for the whole model
(``upcast_model``), before any group's lazy init.

Note: ``upcast`` keeps fp32 master weights (the classic mixed-precision recipe:
``MixedPrecisionPolicy.param_dtype`` still casts for compute); ``preserve``
trains every parameter in the dtype it was loaded in, as single-device training
would, at half the training-state memory for bf16 parameters; ``error`` casts
nothing and names every parameter.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _compat
from . import _compute_dtype, _loaded_dtypes, _optimizer_state
from ._plan import (
    GroupDtypePlan,
    MixedParamDtypeError,
    ParamEntry,
    describe_mixed_dtypes,
    format_dtype,
    plan_model_upcast,
)

logger = logging.getLogger("torch_fsdp_ext")

_KEEP_APART_HINT = (
    "Fix: parameters that must not be cast need one dtype per group: freeze them "
    "(requires_grad_(False)), give them their own fully_shard group, or pass them in ignored_params."
)
# A model refused before any cast (upcast_model): the hand workaround fixes it too.
_REFUSED_UPCAST_HINT = _KEEP_APART_HINT.rstrip(".") + (
    "; or cast the model to one dtype before it is converted and sharded (model.float() before "
    "convert_to_float8_training and fully_shard: the hand workaround, no plugin needed)."
)


class UpcastCost:
    """What ``upcast`` added in this process, so that its memory cost is never silent.

    Note: the first upcast logs one WARNING (on rank 0 only: every rank upcasts the
    same parameters) in the words of the launch configuration a user controls, not
    of ``fully_shard``; each group is logged at INFO. The totals are in ``status()``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.params = 0
        self.bytes = 0  # of master weights on this rank's shards
        self._warned = False

    def add(self, params: int, added_bytes: int) -> None:
        with self._lock:
            self.params += params
            self.bytes += added_bytes

    def warn_once(
        self, model_name: str, params: int, added_bytes: int, widest: str, wide_modules: tuple[str, ...] = ()
    ) -> None:
        """``wide_modules``: modules already in ``widest`` that compute in it (no ``param_dtype``, no override)."""
        with self._lock:
            first, self._warned = not self._warned, True
        if first and params and (not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0):
            # Note: the fp32-module hint is given only where such modules exist: their outputs stay
            # fp32, which a bf16 layer after them rejects (the model fails the same without FSDP).
            # One fact a line, each under 120 columns, so that a log viewer shows it whole.
            lines = [
                f"torch_fsdp_ext: {params} trainable parameter(s) of {model_name} are now {widest} master weights.",
                f"  They add {added_bytes:,} bytes on this rank; with gradients and Adam state, about 4 times that.",
                "  Every module computes in the same dtype as before.",
                "  To keep the loaded dtypes instead, launch with TORCH_FSDP_EXT_DTYPE_STRATEGY=preserve.",
                "  The upcast happens when an optimizer takes the parameters,"
                " or at an earlier first forward or state dict.",
                "  For the final dtypes sooner (an EMA copy, param groups by dtype),"
                " call torch_fsdp_ext.upcast_now(model).",
            ]
            if wide_modules:
                lines += [
                    f"  These modules compute in {widest} and hand {widest} to the next layer:",
                    *(f"    {name}" for name in wide_modules[:3]),
                    *(["    ..."] if len(wide_modules) > 3 else []),
                    "  If that fails ('expected m1 and m2 to have the same dtype'), cast at their boundaries:",
                    "  launch with --compute-in-loaded-dtype CLASS (e.g. LlamaRMSNorm),"
                    " or 'auto' for the model's _keep_in_fp32_modules.",
                ]
            logger.warning("\n".join(lines))


def modules_computing_in(groups: list[tuple[Any, list[ParamEntry]]], dtype: torch.dtype) -> tuple[str, ...]:
    """FQNs of the modules whose trainable parameters are ``dtype`` and compute in it (no cast, no override)."""
    modules = []
    for group, entries in groups:
        for p in entries:
            if (
                p.tensor.dtype == dtype
                and _compat.param_mp_policy(group, p.handle).param_dtype is None
                and _compute_dtype.compute_dtype_of(p.handle) is None
            ):
                module = p.name.rpartition(".")[0] or "<root>"
                if module not in modules:
                    modules.append(module)
    return tuple(modules)


UPCAST_COST: UpcastCost = globals().get("UPCAST_COST") or UpcastCost()

# Note [Installed late] in ``_fix``: on a param group that ``fully_shard`` built before the fix
# was installed (True until its model's upcast said so, then "said").
SHARDED_BEFORE_INSTALL_ATTR = "_torch_fsdp_ext_sharded_before_install"


class UpcastStrategy:
    """fp32 master weights: the narrower trainable floating params of a model are upcast to its widest dtype.

    ``upcast_model`` is the one decision per model (``DtypeFix.upcast_model`` says when);
    ``at_lazy_init`` only handles a group that is still mixed at its own lazy init (a dtype
    changed after that decision, or parameters that must not be cast).
    """

    name = "upcast"

    def upcast_model(
        self, groups: list[tuple[Any, list[ParamEntry]]], model_name: str, group_name: Callable[[Any], str]
    ) -> list[tuple[Any, list[str]]]:
        """Upcast ``groups`` (each with its parameters as the module holds them now; ``group_name`` names one in
        messages); returns the groups changed, each with the names of its parameters upcast. Every group is
        checked before any changes."""
        widest, casts, refused = plan_model_upcast([entries for _, entries in groups])
        if refused:
            messages = []
            for index, plan in refused:
                name = f"{group_name(groups[index][0])!r} of {model_name}"
                messages.append(describe_mixed_dtypes(name, plan, self._conflicts(plan), ""))
            raise MixedParamDtypeError(
                "\n".join(message.rstrip("\n") for message in messages)
                + "\nNothing was cast: upcast needs every parameter of a group in one dtype. " + _REFUSED_UPCAST_HINT
            )
        changed, params, added = [], 0, 0
        for (group, _), group_casts in zip(groups, casts):
            if group_casts:
                added += self._upcast(group, group_casts, widest, f"{group_name(group)!r} of {model_name}")
                params += len(group_casts)
                changed.append((group, [p.name for p in group_casts]))
        if changed:
            UPCAST_COST.warn_once(
                model_name, params, added, format_dtype(widest), modules_computing_in(groups, widest)
            )
        return changed

    def at_lazy_init(self, group: Any, plan: GroupDtypePlan, group_name: str) -> bool:
        conflicts = self._conflicts(plan)
        if conflicts:
            raise MixedParamDtypeError(describe_mixed_dtypes(group_name, plan, conflicts, _KEEP_APART_HINT))
        added = self._upcast(group, plan.narrower(), plan.widest, group_name)
        UPCAST_COST.warn_once(f"FSDP2 group {group_name}", len(plan.narrower()), added, format_dtype(plan.widest))
        return False

    @staticmethod
    def _upcast(group: Any, casts: list[ParamEntry], widest: Any, group_name: str) -> int:
        added = sum(_compat.local_shard_numel(p.handle) * (widest.itemsize - p.tensor.dtype.itemsize) for p in casts)
        logger.info(
            "torch_fsdp_ext: upcast %d trainable parameter(s) of FSDP2 group %s to %s master weights "
            "(+%s bytes on this rank's shards): %s",
            len(casts), group_name, format_dtype(widest), f"{added:,}",
            ", ".join(f"{p.name} ({format_dtype(p.tensor.dtype)})" for p in casts),
        )
        for p in casts:
            upcast_param(group, p.handle, widest)
        UPCAST_COST.add(len(casts), added)
        return added

    @staticmethod
    def _conflicts(plan: GroupDtypePlan) -> dict[int, str]:
        return {id(p): f"must not be cast: {why}" for p, why in plan.keep_dtype if p.tensor.dtype != plan.widest}


def change_sharded_param_dtype(fsdp_param: Any, dtype: torch.dtype) -> None:
    """Cast an already-sharded FSDP2 parameter to ``dtype`` in place.

    The ``nn.Parameter`` object keeps its identity (``swap_tensors``), so an
    optimizer that already holds it keeps stepping the parameter the model uses.
    ``reset_sharded_param`` then re-pads the new local shard and re-pins it when
    CPU offload asks for pinned memory. Between ``unshard()`` and ``reshard()`` only the
    sharded parameter changes (the master); the unsharded view the module holds keeps its
    values, which are what an all-gather of the new master would give.
    """
    from torch.distributed.tensor import DTensor

    param = fsdp_param.sharded_param
    replacement = torch.nn.Parameter(
        DTensor.from_local(
            _compat.local_tensor_of(param).to(dtype),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        ),
        requires_grad=param.requires_grad,
    )
    torch.utils.swap_tensors(param, replacement)
    _compat.reset_sharded_param(fsdp_param)


def upcast_param(group: Any, fsdp_param: Any, dtype: Any) -> None:
    """One sharded parameter becomes a ``dtype`` master weight that computes as it did before.

    Note: where the policy casts nothing for compute (no ``param_dtype``: accelerate's
    ``mixed_precision: "no"``, ``fully_shard`` without a policy), the parameter is
    all-gathered in the dtype it was loaded in, so its module computes exactly as
    before: an fp32 master must not turn a bf16 norm's output fp32 in front of a frozen
    bf16 layer (``mat1 and mat2 must have the same dtype``).
    """
    _compat.sync_sharded_param(fsdp_param)
    upcast_sharded_param(group, fsdp_param, dtype)


def upcast_sharded_param(group: Any, fsdp_param: Any, dtype: Any, state_dtype_before: Any = None) -> None:
    """``upcast_param`` for a parameter whose module holds its sharded parameter (FSDP's own).

    ``state_dtype_before``: the dtype of optimizer state made for it before (default: its dtype now)."""
    loaded = fsdp_param.sharded_param.dtype
    _loaded_dtypes.remember_loaded_dtype(fsdp_param, loaded)
    change_sharded_param_dtype(fsdp_param, dtype)
    if _compute_dtype.compute_dtype_of(fsdp_param) is None and _compat.param_mp_policy(group, fsdp_param).param_dtype is None:
        _compute_dtype.compute_in(group, fsdp_param, loaded)
    _optimizer_state.remember_upcast(
        fsdp_param, state_dtype_before or loaded, sharded_before_install=SHARDED_BEFORE_INSTALL_ATTR in group.__dict__
    )


class PreserveStrategy:
    """Native mixed groups: every parameter, gradient and optimizer state keeps its own dtype.

    Gradients of the group are reduced in one dtype (``reduce_dtype`` when set,
    else the promoted dtype of the parameters, whose dtypes the gradients follow)
    and each parameter receives its gradient cast to its own dtype after the
    reduce-scatter (``_compat``).
    """

    name = "preserve"

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
