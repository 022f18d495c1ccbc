"""The dtype plan of one FSDP2 param group: which trainable dtypes it mixes, and
which parameters must keep theirs whatever the strategy.

Note: the plan depends only on dtypes and ``requires_grad`` flags, so every rank
of a group that built the same model makes the same plan. The strategies
(``_strategies.py``) decide what to do with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import _compat

_FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


class MixedParamDtypeError(RuntimeError):
    """A param group's trainable parameters have dtypes the chosen strategy cannot handle."""


@dataclass
class ParamEntry:
    name: str
    tensor: torch.Tensor  # the plain param, or the sharded DTensor param
    handle: Any  # the nn.Parameter (before sharding) or the FSDPParam (after)


@dataclass
class GroupDtypePlan:
    """The trainable dtypes of one param group."""

    trainable: list[ParamEntry] = field(default_factory=list)
    # Trainable parameters whose dtype must not change (quantized storage, float8, extensions), with why.
    keep_dtype: list[tuple[ParamEntry, str]] = field(default_factory=list)
    widest: torch.dtype | None = None  # the promoted dtype of the floating trainable parameters

    @property
    def is_mixed(self) -> bool:
        return len({p.tensor.dtype for p in self.trainable}) > 1

    def narrower(self) -> list[ParamEntry]:
        """Castable trainable parameters narrower than ``widest``: what an upcast changes."""
        kept = {id(p) for p, _ in self.keep_dtype}
        return [p for p in self.trainable if id(p) not in kept and p.tensor.dtype != self.widest]

    def added_bytes(self, numel: Callable[[ParamEntry], int]) -> int:
        """Bytes an upcast of ``narrower()`` adds, counting ``numel(entry)`` elements each."""
        return sum(numel(p) * (self.widest.itemsize - p.tensor.dtype.itemsize) for p in self.narrower())


def cast_exclusion_reason(tensor: torch.Tensor) -> str | None:
    """Why a trainable parameter must keep its dtype, or ``None`` if it is a plain floating tensor."""
    if not tensor.dtype.is_floating_point:
        return "non-floating storage (quantized?)"
    if tensor.dtype in _FLOAT8_DTYPES:
        return "float8"
    # Note: after fully_shard the parameter is a DTensor; the extension is its local tensor.
    if hasattr(_compat.local_tensor_of(tensor), "fsdp_pre_all_gather") or hasattr(tensor, "fsdp_pre_all_gather"):
        return "tensor subclass with fsdp_pre_all_gather"
    return None


def param_names(modules: tuple) -> dict[int, str]:
    """``id(param) -> "Class:name"`` for a group's parameters before sharding (FQNs exist only after)."""
    names = {}
    for module in reversed(modules):
        prefix = type(module).__name__
        for name, param in module.named_parameters(remove_duplicate=False):
            names[id(param)] = f"{prefix}:{name}"
    return names


def plan_group_dtypes(params: list[ParamEntry]) -> GroupDtypePlan:
    trainable = [p for p in params if p.tensor.requires_grad]
    plan = GroupDtypePlan(trainable=trainable)
    if not plan.is_mixed:
        return plan
    for p in trainable:
        reason = cast_exclusion_reason(p.tensor)
        if reason is not None:
            plan.keep_dtype.append((p, reason))
    plan.widest = _widest([p.tensor.dtype for p in trainable])
    return plan


def _widest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The promoted dtype of everything that takes part in type promotion (float8 does not)."""
    promotable = [d for d in dtypes if d.is_floating_point and d not in _FLOAT8_DTYPES]
    return functools.reduce(torch.promote_types, promotable) if promotable else None


def plan_model_upcast(
    groups: list[list[ParamEntry]],
) -> tuple[torch.dtype | None, list[list[ParamEntry]], list[tuple[int, GroupDtypePlan]]]:
    """For a model's param groups: the widest trainable dtype, per group the parameters to upcast
    to it, and the groups that would stay mixed (index, plan).

    Nothing is upcast unless some group mixes trainable dtypes (FSDP takes the model as it
    is otherwise). A group holding a parameter that must keep a dtype other than the widest
    is left as it is: upcasting its other parameters would make it mixed. If it is mixed
    already, no upcast can fix it: it is returned among the refused, and the caller
    changes nothing (a refusal leaves the whole model as loaded).
    """
    trainable = [[p for p in entries if p.tensor.requires_grad] for entries in groups]
    widest = _widest([p.tensor.dtype for entries in trainable for p in entries])
    if widest is None or not any(len({p.tensor.dtype for p in entries}) > 1 for entries in trainable):
        return widest, [[] for _ in groups], []
    casts, refused = [], []
    for index, entries in enumerate(trainable):
        kept = [p for p in entries if cast_exclusion_reason(p.tensor) is not None]
        if any(p.tensor.dtype != widest for p in kept):
            casts.append([])
            plan = plan_group_dtypes(entries)
            if plan.is_mixed:
                refused.append((index, plan))
            continue
        casts.append([p for p in entries if p.tensor.dtype != widest])
    return widest, casts, refused


def format_dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_mixed_dtypes(group_name: str, plan: GroupDtypePlan, why_not: dict[int, str], fix_hint: str) -> str:
    """The error text: every trainable parameter with its FQN and dtype, those in ``why_not`` marked."""
    by_dtype: dict[torch.dtype, list[ParamEntry]] = {}
    for p in plan.trainable:
        by_dtype.setdefault(p.tensor.dtype, []).append(p)
    lines = [
        f"torch_fsdp_ext: FSDP2 param group {group_name} needs one dtype for its trainable "
        f"parameters but has {', '.join(sorted(format_dtype(d) for d in by_dtype))}:"
    ]
    for dtype, group in sorted(by_dtype.items(), key=lambda item: (len(item[1]), str(item[0]))):
        for p in group:
            note = f" ({why_not[id(p)]})" if id(p) in why_not else ""
            lines.append(f"  {p.name}: {format_dtype(dtype)}{note}")
    lines.append(fix_hint)
    return "\n".join(lines)
