"""Dtype normalization: one FSDP2 param group may hold trainable params of several dtypes.

FSDP2 all-gathers and reduce-scatters a group's parameters as one flat buffer, so
``FSDPParamGroup._init_mp_dtypes`` insists that all trainable parameters share one
original dtype:

    AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}

Note: the repair keeps *fp32 master weights*. Lower-precision trainable floating
params are upcast to the widest dtype of the group, and
``MixedPrecisionPolicy.param_dtype`` keeps doing the low-precision cast for
compute. Downcasting instead would silently turn mixed precision into pure bf16
training and lose small optimizer updates.

Two hooks do the work:

- before ``FSDPParamGroup.__init__`` shards anything, plain params are upcast in
  place (``param.data = ...``), which is the cheapest moment;
- right before ``_init_mp_dtypes`` (lazy init, first forward), already-sharded
  params are upcast in place (``swap_tensors``), which catches dtype changes made
  after ``fully_shard`` and groups built before ``install()``.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import _compat
from ._patching import PatchSet, wraps
from ._rank_consistency import RankConsistency

logger = logging.getLogger("torch_fsdp_ext")

STRATEGIES = ("upcast", "error")

_FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


class MixedParamDtypeError(RuntimeError):
    """A param group's trainable parameters have dtypes that cannot be made uniform."""


@dataclass
class _Param:
    name: str
    tensor: torch.Tensor  # the plain param, or the sharded DTensor param
    handle: Any  # the nn.Parameter (before sharding) or the FSDPParam (after)


@dataclass
class UniformDtypePlan:
    """What to do with one param group's trainable parameters."""

    target: torch.dtype | None = None
    casts: list[_Param] = field(default_factory=list)
    fixed: list[tuple[_Param, str]] = field(default_factory=list)  # trainable, must not be cast
    trainable: list[_Param] = field(default_factory=list)

    @property
    def conflicts(self) -> list[tuple[_Param, str]]:
        return [(p, why) for p, why in self.fixed if p.tensor.dtype != self.target]

    def added_bytes(self, numel: Callable[[_Param], int]) -> int:
        return sum(numel(p) * (self.target.itemsize - p.tensor.dtype.itemsize) for p in self.casts)


def cast_exclusion_reason(tensor: torch.Tensor) -> str | None:
    """Why a trainable parameter must keep its dtype, or ``None`` if it may be upcast."""
    if not tensor.dtype.is_floating_point:
        return "non-floating storage (quantized?)"
    if tensor.dtype in _FLOAT8_DTYPES:
        return "float8"
    local = tensor.__dict__.get("_local_tensor", tensor)
    if hasattr(local, "fsdp_pre_all_gather") or hasattr(tensor, "fsdp_pre_all_gather"):
        return "tensor subclass with fsdp_pre_all_gather"
    return None


def plan_uniform_dtype(params: list[_Param]) -> UniformDtypePlan:
    """Decide the casts; depends only on dtypes and flags, so every rank decides alike."""
    trainable = [p for p in params if p.tensor.requires_grad]
    plan = UniformDtypePlan(trainable=trainable)
    if len({p.tensor.dtype for p in trainable}) <= 1:
        return plan
    castable = []
    for p in trainable:
        reason = cast_exclusion_reason(p.tensor)
        if reason is None:
            castable.append(p)
        else:
            plan.fixed.append((p, reason))
    # The widest dtype among everything that takes part in type promotion (float8 does not).
    promotable = [p.tensor.dtype for p in trainable if p.tensor.dtype.is_floating_point and p.tensor.dtype not in _FLOAT8_DTYPES]
    if promotable:
        plan.target = functools.reduce(torch.promote_types, promotable)
    plan.casts = [p for p in castable if p.tensor.dtype != plan.target]
    return plan


def _format_dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_mixed_dtypes(group_name: str, plan: UniformDtypePlan, strategy: str) -> str:
    by_dtype: dict[torch.dtype, list[_Param]] = {}
    for p in plan.trainable:
        by_dtype.setdefault(p.tensor.dtype, []).append(p)
    why = dict((id(p), reason) for p, reason in plan.fixed)
    lines = [
        f"torch_fsdp_ext: FSDP2 param group {group_name} needs one dtype for its trainable "
        f"parameters but has {', '.join(sorted(_format_dtype(d) for d in by_dtype))}:"
    ]
    for dtype, group in sorted(by_dtype.items(), key=lambda item: (len(item[1]), str(item[0]))):
        for p in group:
            note = f" (must not be cast: {why[id(p)]})" if id(p) in why else ""
            lines.append(f"  {p.name}: {_format_dtype(dtype)}{note}")
    if strategy == "error":
        lines.append(
            "Fix: install the plugin with dtype_strategy='upcast' to keep fp32 master weights, or cast these "
            "parameters to one dtype before fully_shard (e.g. model.float()), or freeze them (requires_grad_(False))."
        )
    else:
        lines.append(
            "Fix: parameters that must not be cast need one dtype per group: freeze them "
            "(requires_grad_(False)), give them their own fully_shard group, or pass them in ignored_params."
        )
    return "\n".join(lines)


class DtypeNormalization:
    """The ``dtype`` fix."""

    name = "dtype"
    summary = "mixed trainable parameter dtypes in one fully_shard group (fp32 master weights)"

    def __init__(self, internals: _compat.TorchInternals, strategy: str = "upcast") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"dtype_strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.internals = internals
        self.strategy = strategy
        self.active = False
        self.counts_frozen = False
        self.ranks = RankConsistency(internals, MixedParamDtypeError)

    def needed(self) -> tuple[bool, str]:
        rejects = _compat.probe_rejects_mixed_trainable_dtypes()
        if rejects is False:
            return False, "this torch accepts mixed trainable dtypes in one group"
        if rejects is None:
            return True, "could not probe _init_mp_dtypes; assuming the uniform-dtype check is there"
        return True, "_init_mp_dtypes asserts one dtype for all trainable params of a group"

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("FSDPParamGroup", "FSDPState._lazy_init"))

    def install(self, patches: PatchSet) -> None:
        self.counts_frozen = bool(_compat.probe_dtype_check_counts_frozen())
        group_cls = self.internals.FSDPParamGroup
        patches.wrap(group_cls, "__init__", self._wrap_init)
        patches.wrap(group_cls, "_init_mp_dtypes", self._wrap_init_mp_dtypes)
        self.ranks.install(patches)
        self.active = True

    # -- hook 1: before sharding ------------------------------------------------

    def _wrap_init(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def __init__(group: Any, *args: Any, **kwargs: Any) -> None:
            if fix.active and fix.strategy == "upcast":
                bound = _compat.bind_param_group_init(original, (group, *args), kwargs)
                fix.upcast_before_sharding(
                    bound.arguments["params"], bound.arguments["modules"], bound.arguments["mp_policy"]
                )
            original(group, *args, **kwargs)

        return __init__

    def upcast_before_sharding(self, params: list[torch.nn.Parameter], modules: tuple, mp_policy: Any) -> None:
        names = {}
        for module in reversed(modules):
            prefix = type(module).__name__
            for name, param in module.named_parameters(remove_duplicate=False):
                names[id(param)] = f"{prefix}:{name}"
        plan = plan_uniform_dtype([_Param(names.get(id(p), f"<param {i}>"), p, p) for i, p in enumerate(params)])
        if not plan.casts or plan.conflicts:
            return  # nothing to do, or an error that lazy init reports with full FQNs
        group_name = ", ".join(type(m).__name__ for m in modules)
        added = plan.added_bytes(lambda p: p.tensor.numel())
        self._report(group_name, plan, mp_policy.param_dtype is None, f"{added} bytes before sharding")
        for p in plan.casts:
            p.handle.data = p.handle.data.to(plan.target)

    # -- hook 2: right before the uniform-dtype check -----------------------------

    def _wrap_init_mp_dtypes(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def _init_mp_dtypes(group: Any) -> None:
            if not fix.active:
                return original(group)
            fix.normalize_sharded_group(group)
            fix.ranks.note_layout(group)
            if fix.counts_frozen:
                return fix._init_mp_dtypes_trainable_only(original, group)
            return original(group)

        return _init_mp_dtypes

    def normalize_sharded_group(self, group: Any) -> None:
        params = [
            _Param(_compat.fsdp_param_fqn(p) or f"<param {i}>", p.sharded_param, p)
            for i, p in enumerate(group.fsdp_params)
        ]
        plan = plan_uniform_dtype(params)
        if not plan.casts and not plan.conflicts:
            return
        group_name = getattr(group, "_module_fqn", None) or "<root>"
        if self.strategy == "error" or plan.conflicts:
            raise MixedParamDtypeError(describe_mixed_dtypes(repr(group_name), plan, self.strategy))
        added = plan.added_bytes(lambda p: _compat.local_shard_numel(p.handle))
        computes_in_target = any(_compat.param_mp_policy(group, p.handle).param_dtype is None for p in plan.casts)
        self._report(repr(group_name), plan, computes_in_target, f"{added} bytes on this rank's shards")
        for p in plan.casts:
            _compat.change_sharded_param_dtype(p.handle, plan.target)

    def _report(self, group_name: str, plan: UniformDtypePlan, computes_in_target: bool, added: str) -> None:
        casts = ", ".join(f"{p.name} ({_format_dtype(p.tensor.dtype)})" for p in plan.casts)
        logger.info(
            "torch_fsdp_ext: upcast %d trainable parameter(s) of FSDP2 group %s to %s for uniform "
            "fp32 master weights (+%s): %s",
            len(plan.casts), group_name, _format_dtype(plan.target), added, casts,
        )
        if computes_in_target:
            warnings.warn(
                f"torch_fsdp_ext: FSDP2 group {group_name} has no MixedPrecisionPolicy.param_dtype, so the "
                f"parameters upcast to {_format_dtype(plan.target)} now also compute in "
                f"{_format_dtype(plan.target)}: {casts}. Pass "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) to keep "
                "low-precision compute with fp32 master weights.",
                stacklevel=2,
            )

    @staticmethod
    def _init_mp_dtypes_trainable_only(original: Callable, group: Any) -> None:
        """For releases whose check also counts frozen params: check trainable ones only."""
        everything = group.fsdp_params
        group.fsdp_params = [p for p in everything if _compat.fsdp_param_is_trainable(p)]
        try:
            original(group)
        finally:
            group.fsdp_params = everything
        for p in everything:
            p.init_dtype_attrs(_compat.param_mp_policy(group, p))
