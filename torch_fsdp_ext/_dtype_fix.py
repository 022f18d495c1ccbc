"""The ``dtype`` fix: one FSDP2 param group may hold trainable params of several dtypes.

FSDP2 all-gathers and reduce-scatters a group's parameters as one flat buffer, so
``FSDPParamGroup._init_mp_dtypes`` insists that all trainable parameters share one
original dtype:

    AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}

Two hooks hand a mixed group to the chosen strategy (``_dtype_strategies.py``):

- before ``FSDPParamGroup.__init__`` shards anything (the cheapest moment to cast);
- right before ``_init_mp_dtypes`` (lazy init, first forward), which also catches
  dtype changes made after ``fully_shard`` and groups built before ``install()``.

The ``__init__`` hook also resolves ``MixedPrecisionPolicy.param_dtype_override_fn`` on
the parameters as loaded, before any cast, and the lazy-init hook applies it
(``_compute_dtype.py``).

A group that stays mixed (``preserve``) passes FSDP's check through
``_compat.init_mp_dtypes_of_mixed_group``; on releases whose reduce-scatter casts
the whole output to one dtype, ``_compat`` also wraps that path so that each
parameter receives its gradient in its own dtype.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from . import _compat, _compute_dtype
from ._dtype_plan import MixedParamDtypeError, ParamEntry, format_dtype, param_names, plan_group_dtypes
from ._dtype_strategies import UPCAST_COST, make_strategy
from ._patching import PatchSet, wraps
from ._rank_consistency import RankConsistency


class DtypeFix:
    """The ``dtype`` fix."""

    name = "dtype"
    summary = "mixed trainable parameter dtypes in one fully_shard group"

    def __init__(self, internals: _compat.TorchInternals, strategy: str = "upcast") -> None:
        self.internals = internals
        self.strategy = make_strategy(strategy)
        self.active = False
        self.counts_frozen = False
        self.ranks = RankConsistency(internals, MixedParamDtypeError)
        self._patches: PatchSet | None = None
        self._refused: weakref.WeakSet = weakref.WeakSet()  # root modules whose forward now raises

    def set_strategy(self, name: str) -> None:
        self.strategy = make_strategy(name)
        if self.active:
            self.refuse_half_initialised_models(self._patches)

    def needed(self) -> tuple[bool, str]:
        rejects = _compat.probe_rejects_mixed_trainable_dtypes()
        if rejects is False:
            return False, "this torch accepts mixed trainable dtypes in one group"
        if rejects is None:
            return True, "could not probe _init_mp_dtypes; assuming the uniform-dtype check is there"
        return True, "_init_mp_dtypes asserts one dtype for all trainable params of a group"

    def wrapped_symbols(self) -> list[str]:
        owners = ("FSDPParamGroup",) if _compat.probe_reduce_casts_grads_per_param() else _compat.MIXED_REDUCE_OWNERS
        return _compat.symbol_names(self.internals, (*owners, "FSDPState._lazy_init"))

    def install(self, patches: PatchSet) -> None:
        self.counts_frozen = bool(_compat.probe_dtype_check_counts_frozen())
        group_cls = self.internals.FSDPParamGroup
        patches.wrap(group_cls, "__init__", self._wrap_init)
        patches.wrap(group_cls, "_init_mp_dtypes", self._wrap_init_mp_dtypes)
        if not _compat.probe_reduce_casts_grads_per_param():
            _compat.wrap_reduce_for_mixed_groups(patches)
        self.ranks.install(patches)
        self.refuse_half_initialised_models(patches)
        self._patches = patches
        self.active = True

    def refuse_half_initialised_models(self, patches: PatchSet) -> None:
        """A model whose first forward failed in FSDP's lazy init (before this fix, or under
        ``dtype_strategy="error"``) cannot be repaired in place: its next forward says so
        instead of failing with an ``AttributeError`` deep inside FSDP."""
        for modules, unfinished in _compat.half_initialised_roots():
            if any(module in self._refused for module in modules):
                continue
            roots = ", ".join(type(module).__name__ for module in modules)
            message = (
                f"torch_fsdp_ext: the first forward of this FSDP2 model (root module {roots}) failed during FSDP's "
                f"lazy initialization, which left param group(s) {', '.join(map(repr, unfinished))} half set up, "
                "and FSDP2 never redoes that setup on the same model. Build the model again and call fully_shard "
                "on it (with torch_fsdp_ext installed first) before the next forward."
            )
            for module in modules:
                # Note: torch's public hook API, ahead of FSDP's own pre-forward hook.
                hook = functools.partial(_refuse_forward, message)
                patches.add_handle(module.register_forward_pre_hook(hook, prepend=True))
                self._refused.add(module)

    # -- hook 1: before sharding ------------------------------------------------

    def _wrap_init(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def __init__(group: Any, *args: Any, **kwargs: Any) -> None:
            if not fix.active:
                return original(group, *args, **kwargs)
            bound = _compat.bind_param_group_init(original, (group, *args), kwargs)
            params, modules, mp_policy = (bound.arguments[k] for k in ("params", "modules", "mp_policy"))
            # Per-parameter compute dtypes are chosen on the parameters as loaded, before any cast.
            overrides = _compute_dtype.resolve_before_sharding(params, modules, mp_policy)
            if overrides is not None:
                bound.arguments["mp_policy"] = overrides.policy
            casts = fix.before_sharding(params, modules, mp_policy) if fix.strategy.name == "upcast" else []
            original(*bound.args, **bound.kwargs)
            if overrides is not None:
                _compute_dtype.after_sharding(group, overrides)
            if casts:
                fix.note_upcast_shards(group, casts, ", ".join(type(m).__name__ for m in modules))

        return __init__

    def before_sharding(self, params: list[torch.nn.Parameter], modules: tuple, mp_policy: Any) -> list:
        """The strategy's cast before sharding: [(index in params, bytes added per element)]."""
        names = param_names(modules)
        index = {id(p): i for i, p in enumerate(params)}
        plan = plan_group_dtypes([ParamEntry(names.get(id(p), f"<param {i}>"), p, p) for i, p in enumerate(params)])
        group_name = ", ".join(type(m).__name__ for m in modules)
        casts = self.strategy.before_sharding(plan, group_name, mp_policy)
        return [(index[id(entry.handle)], per_element) for entry, per_element in casts]

    @staticmethod
    def note_upcast_shards(group: Any, casts: list[tuple[int, int]], group_name: str) -> None:
        """Count what the upcast costs on this rank, now that the group is sharded."""
        # Note: FSDPParamGroup keeps its FSDPParams in the order of the params it was given.
        fsdp_params = group.fsdp_params
        added = sum(_compat.local_shard_numel(fsdp_params[i]) * per_element for i, per_element in casts)
        widest = format_dtype(fsdp_params[casts[0][0]].sharded_param.dtype)
        UPCAST_COST.add(group_name, len(casts), added, widest)

    # -- hook 2: right before the uniform-dtype check -----------------------------

    def _wrap_init_mp_dtypes(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def _init_mp_dtypes(group: Any) -> None:
            if not fix.active:
                return original(group)
            _compute_dtype.check_defaults_matched()
            stays_mixed = fix.prepare_sharded_group(group)
            fix.ranks.note_layout(group)
            if stays_mixed:
                _compat.init_mp_dtypes_of_mixed_group(original, group)
            else:
                _compat.forget_mixed_group(group)
                if fix.counts_frozen:
                    fix._init_mp_dtypes_trainable_only(original, group)
                else:
                    original(group)
            _compute_dtype.at_lazy_init(group)

        return _init_mp_dtypes

    def prepare_sharded_group(self, group: Any) -> bool:
        """Hand a mixed group to the strategy; True if it goes on with mixed dtypes."""
        params = [
            ParamEntry(_compat.fsdp_param_fqn(p) or f"<param {i}>", p.sharded_param, p)
            for i, p in enumerate(group.fsdp_params)
        ]
        plan = plan_group_dtypes(params)
        if not plan.is_mixed:
            return False
        if self.counts_frozen and self.strategy.name == "preserve":
            raise MixedParamDtypeError(
                "torch_fsdp_ext: dtype_strategy='preserve' is not supported on this torch: its _init_mp_dtypes "
                "also counts frozen parameters. Use dtype_strategy='upcast'."
            )
        return self.strategy.at_lazy_init(group, plan, repr(_compat.group_name(group)))

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


def _refuse_forward(message: str, module: torch.nn.Module, args: tuple) -> None:
    raise RuntimeError(message)
