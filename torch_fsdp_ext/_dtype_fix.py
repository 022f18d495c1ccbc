"""The ``dtype`` fix: one FSDP2 param group may hold trainable params of several dtypes.

FSDP2 all-gathers and reduce-scatters a group's parameters as one flat buffer, so
``FSDPParamGroup._init_mp_dtypes`` insists that all trainable parameters share one
original dtype:

    AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}

Two hooks hand a mixed group to the chosen strategy (``_dtype_strategies.py``):

- before ``FSDPParamGroup.__init__`` shards anything (the cheapest moment to cast);
- right before ``_init_mp_dtypes`` (lazy init, first forward), which also catches
  dtype changes made after ``fully_shard``.

Groups built before ``install()`` are handed to the strategy by ``install()`` itself.

The ``__init__`` hook also resolves ``MixedPrecisionPolicy.param_dtype_override_fn`` on
the parameters as loaded, before any cast, and the lazy-init hook applies it
(``_compute_dtype.py``).

A group that stays mixed (``preserve``) passes FSDP's check through
``_compat.init_mp_dtypes_of_mixed_group``; on releases whose reduce-scatter casts
the whole output to one dtype, ``_compat`` also wraps that path so that each
parameter receives its gradient in its own dtype.

Note: a group's strategy is decided once: at the first ``install()`` that finds
the group already built (which also upcasts it right there, before an optimizer
or a checkpoint load can see the old dtype), else at its first lazy init. It is
kept on the group (``GroupDecision``), so a later ``install(dtype_strategy=...)``
does not re-apply another strategy when FSDP re-runs ``_init_mp_dtypes`` from an
explicit ``unshard()``; that re-run only handles what changed since (a dtype the
user changed), with the group's own strategy.

Note: after ``uninstall()`` a live ``preserve`` group still needs the wrappers of
``_init_mp_dtypes`` (``unshard()`` re-runs it) and, up to 2.14, of the reduce
path. They are kept (``GroupKeeper``) and act only on those groups, until the
last of them is garbage-collected; then, or at ``uninstall()`` when there is
none, they are restored by identity.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import _compat, _compute_dtype, _optimizer_state
from ._dtype_plan import MixedParamDtypeError, ParamEntry, format_dtype, param_names, plan_group_dtypes
from ._dtype_strategies import UPCAST_COST, make_strategy
from ._patching import PatchSet, wraps
from ._rank_consistency import RankConsistency

_DECISION_ATTR = "_torch_fsdp_ext_dtype_decision"


@dataclass
class GroupDecision:
    """What the dtype fix decided for one param group, kept on the group."""

    strategy: Any  # the strategy in force when the group was decided
    layout: tuple | None  # (dtype, requires_grad) per parameter when last prepared; None: not prepared yet
    stays_mixed: bool = False


def _layout(group: Any) -> tuple:
    return tuple((p.sharded_param.dtype, p.sharded_param.requires_grad) for p in group.fsdp_params)


class DtypeFix:
    """The ``dtype`` fix."""

    name = "dtype"
    summary = "mixed trainable parameter dtypes in one fully_shard group"

    def __init__(self, internals: _compat.TorchInternals, strategy: str = "upcast") -> None:
        self.internals = internals
        self.strategy = make_strategy(strategy)
        self.active = False
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
        patches.wrap(self.internals.FSDPParamGroup, "__init__", self._wrap_init)
        self.ranks.install(patches)
        _keeper.attach(self)
        self.refuse_half_initialised_models(patches)
        self._patches = patches
        self.active = True

    def release(self) -> None:
        """At uninstall(), after ``active`` went False: what live groups do not need goes."""
        _keeper.detach(self)
        _optimizer_state.release()

    def decide_existing_groups(self) -> None:
        """At install(): groups built before it that no strategy has decided yet are decided now.

        An upcast happens right here, so that an optimizer built and a checkpoint loaded
        after ``install()`` see the fp32 master weights.
        """
        for state in _compat.fsdp_states():
            for group in _compat.param_groups_of(state):
                if _DECISION_ATTR in group.__dict__:
                    continue
                # Note: only before the state's first lazy init; one that failed part-way is refused instead.
                if self.strategy.name == "upcast" and _compat.is_root_flag(state) is None:
                    try:
                        _prepare(group, self.strategy)
                    except MixedParamDtypeError:
                        pass  # raised again, with FQNs, at the group's lazy init
                group.__dict__[_DECISION_ATTR] = GroupDecision(self.strategy, None)

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


# -- hook 2: right before the uniform-dtype check ---------------------------------


def _prepare(group: Any, strategy: Any) -> bool:
    """Hand a mixed sharded group to ``strategy``; True if it goes on with mixed dtypes."""
    params = [ParamEntry(_compat.fsdp_param_name(p, i), p.sharded_param, p) for i, p in enumerate(group.fsdp_params)]
    plan = plan_group_dtypes(params)
    if not plan.is_mixed:
        return False
    if _compat.probe_dtype_check_counts_frozen() and strategy.name == "preserve":
        raise MixedParamDtypeError(
            "torch_fsdp_ext: dtype_strategy='preserve' is not supported on this torch: its _init_mp_dtypes "
            "also counts frozen parameters. Use dtype_strategy='upcast'."
        )
    dtypes_before = {id(p.handle): p.tensor.dtype for p in plan.trainable}
    stays_mixed = strategy.at_lazy_init(group, plan, repr(_compat.group_name(group)))
    for p in plan.trainable:
        if p.handle.sharded_param.dtype != dtypes_before[id(p.handle)]:
            _optimizer_state.remember_upcast(p.handle, dtypes_before[id(p.handle)])
    return stays_mixed


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


class GroupKeeper:
    """The wrappers of ``_init_mp_dtypes`` and of the reduce path, shared by the installed fix
    and by the ``preserve`` groups that are still alive after ``uninstall()``.

    Note: the reduce path is wrapped only while a group whose gradients come in
    several dtypes is alive (``preserve``, or a per-parameter compute dtype; on releases
    whose reduce casts one dtype for the whole group): it runs once per
    group per backward, and a model without such a group would pay for it for nothing.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.fix: DtypeFix | None = None  # the installed fix; None after uninstall()
        self.patches: PatchSet | None = None  # _init_mp_dtypes
        self.reduce_patches: PatchSet | None = None  # the reduce path of mixed groups
        self.kept_groups = 0  # live groups that stayed mixed

    def attach(self, fix: DtypeFix) -> None:
        with self.lock:
            if self.patches is None:
                patches = PatchSet()
                patches.wrap(fix.internals.FSDPParamGroup, "_init_mp_dtypes", self._wrap_init_mp_dtypes)
                self.patches = patches
            self.fix = fix

    def detach(self, fix: DtypeFix) -> None:
        with self.lock:
            if self.fix is fix:
                self.fix = None
            self._restore_if_unused()

    def keep(self, group: Any) -> None:
        """``group`` stays mixed: keep the wrappers until it is garbage-collected."""
        with self.lock:
            if group.__dict__.get("_torch_fsdp_ext_kept"):
                return
            if self.reduce_patches is None and not _compat.probe_reduce_casts_grads_per_param():
                patches = PatchSet()
                try:
                    _compat.wrap_reduce_for_mixed_groups(patches)
                except Exception:
                    patches.restore()
                    raise
                self.reduce_patches = patches
            group.__dict__["_torch_fsdp_ext_kept"] = True
            self.kept_groups += 1
        weakref.finalize(group, self._group_collected)

    def _group_collected(self) -> None:
        with self.lock:
            self.kept_groups -= 1
            self._restore_if_unused()

    def _restore_if_unused(self) -> None:
        if self.kept_groups == 0 and self.reduce_patches is not None:
            self.reduce_patches.restore()
            self.reduce_patches = None
        if self.fix is None and self.kept_groups == 0 and self.patches is not None:
            self.patches.restore()
            self.patches = None

    def _wrap_init_mp_dtypes(self, original: Callable) -> Callable:
        keeper = self

        @wraps(original)
        def _init_mp_dtypes(group: Any) -> None:
            fix = keeper.fix
            decision = group.__dict__.get(_DECISION_ATTR)
            if fix is None and (decision is None or not decision.stays_mixed):
                return original(group)  # uninstalled: torch's own behaviour for every other group
            if fix is not None:
                _compute_dtype.check_defaults_matched()
            if decision is None:
                decision = group.__dict__[_DECISION_ATTR] = GroupDecision(fix.strategy, None)
            layout = _layout(group)
            if layout != decision.layout:  # first lazy init, or the user changed a dtype since
                decision.stays_mixed = _prepare(group, decision.strategy)
                decision.layout = _layout(group)
            if fix is not None:
                fix.ranks.note_layout(group)
            if decision.stays_mixed:
                _compat.init_mp_dtypes_of_mixed_group(original, group)
            else:
                _compat.forget_mixed_group(group)
                if _compat.probe_dtype_check_counts_frozen():
                    _init_mp_dtypes_trainable_only(original, group)
                else:
                    original(group)
            _compute_dtype.at_lazy_init(group)
            if decision.stays_mixed or _compat.is_mixed_group(group):  # preserve, or several compute dtypes
                keeper.keep(group)

        return _init_mp_dtypes


def _refuse_forward(message: str, module: torch.nn.Module, args: tuple) -> None:
    raise RuntimeError(message)


# Note: kept across ``importlib.reload`` (as ``_install`` keeps what is installed), so that
# the wrappers in place are found and restored, not wrapped a second time.
_keeper: GroupKeeper = globals().get("_keeper") or GroupKeeper()
