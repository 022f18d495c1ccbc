"""The ``dtype`` fix: one FSDP2 param group may hold trainable params of several dtypes.

FSDP2 all-gathers and reduce-scatters a group's parameters as one flat buffer, so
``FSDPParamGroup._init_mp_dtypes`` insists that all trainable parameters share one
original dtype:

    AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}

The chosen strategy (``_strategies.py``) gets the model at two moments:

- ``upcast``: once per model (the root's module tree), at the moment of Note [Upcast moment];
- every strategy: right before each group's ``_init_mp_dtypes`` (lazy init, first
  forward), which also catches dtype changes made after that.

The ``FSDPParamGroup.__init__`` hook resolves ``MixedPrecisionPolicy.param_dtype_override_fn``
on the parameters as loaded (``_compute_dtype.py``) and registers the state-dict hooks of
the upcast moment; it casts nothing.

A group that stays mixed (``preserve``) passes FSDP's check through
``_mixed_groups.init_mp_dtypes_of_mixed_group``; on releases whose reduce-scatter casts
the whole output to one dtype, ``_mixed_groups`` also wraps that path so that each
parameter receives its gradient in its own dtype.

Note [Upcast moment]. A model is upcast at the first of: an optimizer taking its
parameters (Note [Optimizers see the upcast] in ``_optimizer_state``), its root's first
lazy init (first forward), the first ``state_dict()`` / ``load_state_dict()`` of one of
its FSDP modules or ``torch.distributed.checkpoint.state_dict`` call on it, and
``torch_fsdp_ext.upcast_now(model)``, each only while the model's trainable
parameters hold data (not meta). Every loader that runs after ``fully_shard`` runs
before the first forward, and each then sees, on every rank, what it would see
without the plugin:
- a loader that captured a state dict before ``fully_shard`` and broadcasts it
  from rank 0 afterwards into buffers of the sharded parameters' dtypes on the
  other ranks (accelerate's ``fsdp2_load_full_state_dict``) works on the meta
  device: an upcast there (or inside ``fully_shard``) would pair rank 0's 2-byte
  elements with 4-byte buffers, and the model would train on garbage;
- a loader that reads into the model's own tensors asks for ``state_dict()`` (DCP)
  or calls ``load_state_dict()`` on materialized parameters first: upcast then, so
  that fp32 masters in the checkpoint are not rounded to bf16 on the way in (an
  upcast at lazy init only would round them). ``set_model_state_dict`` and
  ``set_state_dict`` copy into the local shards before ``load_state_dict()``, and
  ``set_state_dict`` loads the optimizer first: their module-level functions
  (``_compat.state_dict_entry_points``) are the moment for them;
- parameters that ``load_state_dict(assign=True)`` put in place are taken as FSDP's
  lazy init takes them.
The decision depends only on dtypes and ``requires_grad`` flags, the same on every rank.

Note [Scope of the upcast]. What is decided together is one FSDP root's tree: the
top-most module with FSDP state (no ``fully_shard``-ed ancestor) and everything it
shards, as a root's lazy init takes it. Whatever module a moment is given (a plain
container of several models, a PEFT wrapper, the root, a sub-block), the fix finds the
roots that own its parameters (``fsdp_roots_of``) and decides each on its own: a
uniform-bf16 value model next to a mixed policy model stays bf16, and a load into a
sub-block of a model still to be decided upcasts that whole model first, so fp32
values loaded into a bf16 block are not rounded. Every moment (optimizer, forward,
``state_dict()``/``load_state_dict()`` of any submodule, each DCP ``get_*``/``set_*``,
``upcast_now``) goes through it, so the order of the moments changes nothing.

Note [Installed late]. Loads are seen only once the plugin is installed. A group built
by ``fully_shard`` before that (its ``FSDPParamGroup.__init__`` ran unwrapped) is marked
at install; weights loaded into its model before the install went into the loaded
dtypes, and fp32 values were rounded. The plugin cannot tell whether that happened, and
cannot undo it: the model's upcast logs one WARNING naming the model and the fix
(install before ``fully_shard`` and loading), and the stale-optimizer-state error at the
step (``_optimizer_state``) says that the install came late rather than suggesting an order
the user already followed.

Note [Built past the hook]. Another library may wrap ``FSDPParamGroup.__init__`` too. A
wrapper in front of the plugin's, or one the plugin wraps, composes: the plugin binds the
arguments by torch's own signature (found behind any wrapper, ``_compat.torch_own``). One
that calls torch's constructor directly (it captured torch's before the plugin was
imported and replaced the plugin's since) builds a group the plugin never saw: no mark,
no state-dict hooks, so a load before the optimizer would not upcast its model first. At
its model's first lazy init (or ``unshard()``) such a group is taken in (marked, hooked,
decided with its model as any other) where that changes nothing the plugin would have
done differently (its model is uniform, or the strategy casts nothing, and no compute
dtype override applies); otherwise the forward is refused with one error naming the
groups and the wrappers, before anything is cast. The autoload stand-in
(``torch_fsdp_ext_startup``) builds the first group through the hook itself
(``DtypeFix.build_group``), whoever wrapped the stand-in.

Note [Unfrozen later]. A frozen floating parameter narrower than the model's widest
trainable dtype stays as loaded (frozen parameters are never cast). If it is made
trainable later, it becomes a master weight of the widest dtype right before its
group's first gradient reduce-scatter (``FSDPParamGroup.post_backward``), which then
reduces it as it reduces the group's other masters: what ``model.float()`` before
``fully_shard`` gives. Its forward is unchanged (it was all-gathered in its loaded
dtype, which is what the master holds). One frozen *wider* than every trainable
parameter cannot be matched that way (the rest of the model would have to be upcast
with its optimizer state mid-training); making it trainable raises, naming it.

Note: a group's strategy is decided once: at the model's upcast moment or at its
first lazy init. It is kept on the group (``GroupDecision``), so a later
``install(dtype_strategy=...)`` does not re-apply another strategy when FSDP re-runs
``_init_mp_dtypes`` from an explicit ``unshard()``; that re-run only handles what
changed since (a dtype the user changed), with the group's own strategy.

Note: after ``uninstall()`` a live ``preserve`` group, or one built with a
``param_dtype_override_fn`` before 2.15, still needs the wrappers of
``_init_mp_dtypes`` (``unshard()`` re-runs it) and, up to 2.14, of the reduce
path. They are kept (``GroupKeeper``) and act only on those groups, until the
last of them is garbage-collected; then, or at ``uninstall()`` when there is
none, they are restored by identity.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _compat
from .._compat import _dtype as _compat_dtype
from . import _compute_dtype, _mixed_groups, _optimizer_state, _roots
from ._plan import (
    MixedParamDtypeError,
    ParamEntry,
    cast_exclusion_reason,
    describe_mixed_dtypes,
    format_dtype,
    plan_group_dtypes,
)
from ._strategies import SHARDED_BEFORE_INSTALL_ATTR, make_strategy, upcast_sharded_param
from .._patching import PatchSet, wraps
from .._rank_consistency import RankConsistency

_DECISION_ATTR = "_torch_fsdp_ext_dtype_decision"
_BUILT_ATTR = "_torch_fsdp_ext_built_with_plugin"  # the group was built through the fix's hook
_EXISTED_ATTR = "_torch_fsdp_ext_existed_at_install"  # the group was built before the fix was installed

logger = logging.getLogger("torch_fsdp_ext")


@dataclass
class GroupDecision:
    """What the dtype fix decided for one param group, kept on the group."""

    strategy: Any  # the strategy in force when the group was decided
    layout: tuple | None  # (dtype, requires_grad) per parameter when last prepared; None: not prepared yet
    stays_mixed: bool = False
    upcast: bool = False  # its model's upcast changed it
    # Note [Unfrozen later]: frozen parameters to upcast to ``watch_dtype`` once trainable, each with
    # its dtype while frozen (optimizer state made then is in it), and frozen ones wider than it.
    watched: list = field(default_factory=list)  # (FSDPParam, dtype while frozen)
    watched_wider: list = field(default_factory=list)
    watch_dtype: Any = None


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
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # groups whose modules have the state-dict hooks
        # Groups whose model has not been decided with its data loaded: what an optimizer may still take first.
        self._undecided: weakref.WeakSet = weakref.WeakSet()
        # id(parameter the module holds) -> its undecided group: an optimizer's parameters find their
        # groups without a look at every live model's (Note: cost, in _roots). Ids, not weak keys:
        # a weak reference on a parameter breaks torch.utils.swap_tensors (nn.Module.to, float).
        self._undecided_by_param: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Note: the module hooks the fix registers live and die with their modules, not with
        # the fix's patches: a process that builds many models keeps no handle of a freed one.
        self._module_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [handle]
        self._watching = False  # FSDPParamGroup.post_backward is wrapped (Note [Unfrozen later])

    def set_strategy(self, name: str) -> None:
        self.strategy = make_strategy(name)
        if self.active:
            self.refuse_half_initialised_models()

    def needed(self) -> tuple[bool, str]:
        rejects = _compat_dtype.probe_rejects_mixed_trainable_dtypes()
        if rejects is False:
            return False, "this torch accepts mixed trainable dtypes in one group"
        if rejects is None:
            # Note: not assumed to be there: upstream may have fixed it in a way the probe cannot
            # run, and upcasting behind the user's back would change training. torch's own
            # check, if it is still there, stays loud.
            return None, ("cannot tell whether this torch still rejects mixed trainable dtypes (its _init_mp_dtypes "
                          "did not run on the probe's stand-in group); nothing is upcast, and torch's own check "
                          "applies")
        if _compat_dtype.probe_uniform_dtype_check() == "lazy_init":
            return True, ("FSDPParamGroup.lazy_init asserts one dtype for all trainable params of a group (outside "
                          "_init_mp_dtypes); upcast still fixes it, preserve cannot")
        return True, "_init_mp_dtypes asserts one dtype for all trainable params of a group"

    def wrapped_symbols(self) -> list[str]:
        """FSDP2's own functions, wrapped from ``install()`` on."""
        owners = ("FSDPParamGroup",) if _compat_dtype.probe_reduce_casts_grads_per_param() else _compat_dtype.MIXED_REDUCE_OWNERS
        return _compat.symbol_names(self.internals, (*owners, "FSDPState.init", "FSDPState._lazy_init"))

    def outside_fsdp_symbols(self) -> list[str]:
        """What optimizers and DCP run for any model: wrapped from the first FSDP2 state on (Note [Armed] in
        ``_install``)."""
        entry_points = [f"{module.__name__}.{name}" for module, name in _compat.state_dict_entry_points()]
        return entry_points + ["torch.optim.Optimizer.add_param_group"]

    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        patches.on_restore(self._remove_module_hooks)
        patches.wrap(self.internals.FSDPParamGroup, "__init__", self._wrap_init)
        patches.wrap(self.internals.FSDPState, "init", _wrap_state_init)
        self.ranks.install(patches)
        # Note: wrapped after the rank check, so it runs first: the ranks compare the upcast layout.
        patches.wrap(self.internals.FSDPState, "_lazy_init", self._wrap_root_lazy_init)
        _keeper.attach(self)
        self.refuse_half_initialised_models()
        self.active = True

    def install_outside_fsdp(self, patches: PatchSet) -> None:
        """Note [Upcast moment]: the DCP entry points and optimizers, once an FSDP2 group can need them."""
        for entry_point in _compat.state_dict_entry_points():
            patches.wrap(*entry_point, self._wrap_state_dict_entry_point)
        _optimizer_state.wrap_add_param_group(patches, self.upcast_models_holding)

    def release(self) -> None:
        """At uninstall(), after ``active`` went False: what live groups do not need goes."""
        _keeper.detach(self)
        _optimizer_state.release()

    def _add_module_hook(self, module: torch.nn.Module, handle: Any) -> None:
        self._module_hooks.setdefault(module, []).append(handle)

    def _remove_module_hooks(self) -> None:
        for handles in list(self._module_hooks.values()):
            for handle in handles:
                handle.remove()
        self._module_hooks.clear()

    def decide_existing_groups(self) -> None:
        """At install(): models sharded before it get the hooks of their upcast moment."""
        for state in _compat.fsdp_states():
            _roots.index.register(state)
            unfinished = _compat.is_root_flag(state) is None  # its lazy init has not run
            for group in _compat.param_groups_of(state):
                if _BUILT_ATTR not in group.__dict__:
                    group.__dict__.setdefault(_EXISTED_ATTR, True)  # Note [Built past the hook]
                    if unfinished:  # Note [Installed late]
                        group.__dict__.setdefault(SHARDED_BEFORE_INSTALL_ATTR, True)
                if unfinished:
                    self.hook_state_dicts(group, state._modules)

    # -- Note [Built past the hook] ---------------------------------------------------

    def adopt_groups_built_past_the_hook(self, module: torch.nn.Module) -> None:
        """The groups of ``module``'s models that were built while the fix was installed but not through its
        ``FSDPParamGroup.__init__`` hook: taken in where that changes nothing, else refused by name."""
        for root in fsdp_roots_of([module]):
            states = _compat.fsdp_states_under(root)
            groups = [g for state in states for g in _compat.param_groups_of(state) if _built_past_the_hook(g)]
            if not groups:
                continue
            trainable = {
                p.sharded_param.dtype for state in states for group in _compat.param_groups_of(state)
                for p in group.fsdp_params
                if _compat.fsdp_param_is_trainable(p) and cast_exclusion_reason(p.sharded_param) is None
            }
            overrides = any(
                _compute_dtype.override_fn_of(_compat.param_mp_policy(group, p))
                for group in groups for p in group.fsdp_params
            )
            if overrides or _compute_dtype.default_selectors() or (
                len(trainable) > 1 and self.strategy.name == "upcast"
            ):
                _refuse_built_past_the_hook(root, groups, self.internals.FSDPParamGroup.__init__)
            for group in groups:
                group.__dict__[_BUILT_ATTR] = True
                self.hook_state_dicts(group, _compat.group_modules(group))

    def build_group(self, init: Callable, group: Any, *args: Any, **kwargs: Any) -> None:
        """Build ``group`` with torch's ``init`` through the fix's hook, unless the hook is already building it
        (the autoload stand-in, reached through a wrapper another library put over it)."""
        if group.__dict__.get(_BUILT_ATTR) is None:
            self._wrap_init(init)(group, *args, **kwargs)
        else:
            init(group, *args, **kwargs)

    # -- the upcast moment (Note [Upcast moment]) -------------------------------------

    def hook_state_dicts(self, group: Any, modules: tuple) -> None:
        """Public module hooks, removed at uninstall(); a model's first hook to run decides it.

        Note: also on the modules that hold the group's parameters, so that ``load_state_dict()``
        of any submodule (a block's attention, not itself sharded) upcasts the model before it
        copies a value; those hooks act only while the model is undecided.
        """
        if group in self._hooked:
            return
        self._hooked.add(group)
        self._undecided.add(group)
        self._index_params(group)
        fix_ref = weakref.ref(self)
        hook = functools.partial(_upcast_before_state_dict, fix_ref)
        reindex_hook = functools.partial(_reindex_after_load, fix_ref, weakref.ref(group))
        for module in modules:
            self._add_module_hook(module, module.register_state_dict_pre_hook(hook))
            self._add_module_hook(module, module.register_load_state_dict_pre_hook(hook))
        undecided_hook = functools.partial(_upcast_before_load_into, fix_ref, weakref.ref(group))
        for module in _param_holders(group, modules):
            self._add_module_hook(module, module.register_load_state_dict_pre_hook(undecided_hook))
        for module in (*modules, *_param_holders(group, modules)):
            self._add_module_hook(module, module.register_load_state_dict_post_hook(reindex_hook))

    def _index_params(self, group: Any) -> None:
        for fsdp_param in group.fsdp_params:
            self._undecided_by_param[id(_compat.current_module_param(fsdp_param))] = group

    def _decided(self, group: Any) -> None:
        self._undecided.discard(group)
        for fsdp_param in group.fsdp_params:
            key = id(_compat.current_module_param(fsdp_param))
            if self._undecided_by_param.get(key) is group:
                del self._undecided_by_param[key]

    def upcast_models_holding(self, params: list) -> None:
        """Note [Optimizers see the upcast]: upcast the undecided models that hold any of ``params``."""
        if not self.active or not self._undecided:
            return
        ids = {id(p) for p in params}
        groups = []
        for param in params:
            group = self._undecided_by_param.get(id(param))
            # An id may have been reused by a later parameter: the group must still hold it.
            if group is not None and all(g is not group for g in groups) and group in self._undecided and any(
                id(_compat.current_module_param(p)) in ids for p in group.fsdp_params
            ):
                groups.append(group)
        if groups:
            for root in fsdp_roots_of([_compat.group_modules(group)[0] for group in groups]):
                self.upcast_root(root)

    def upcast_now(self, root: torch.nn.Module) -> list[str]:
        """``torch_fsdp_ext.upcast_now``: the model's upcast moment, now."""
        for name, param in root.named_parameters():
            if param.requires_grad and _compat.local_tensor_of(param).is_meta:
                raise ValueError(
                    f"torch_fsdp_ext.upcast_now: {name} is still on the meta device; load the model's weights "
                    "(to_empty() and init, or its checkpoint) first, then call upcast_now(model)."
                )
        return self.upcast_model(root)

    def upcast_model(self, module: torch.nn.Module) -> list[str]:
        """Note [Scope of the upcast]: the ``upcast`` decision for each FSDP root that owns parameters
        of ``module`` (a container of models, the root, a sub-block), per root tree.

        Returns the names of the parameters it upcast now (FQNs under ``module`` where it contains them).
        """
        roots = fsdp_roots_of([module])
        inside = [root for root in roots if root is not module and _contains(module, root)]
        names = _param_names(module) if inside else None
        upcast = []
        for root in roots:
            upcast.extend(self.upcast_root(root, names if any(root is r for r in inside) else None))
        return upcast

    def upcast_root(self, root: torch.nn.Module, names: dict[int, str] | None = None) -> list[str]:
        """The ``upcast`` decision for the model under ``root`` (an FSDP root), made once for all its groups.

        Returns the names of the parameters it upcast now (``names``: their FQNs; default: under ``root``).
        """
        groups = []
        for state in _compat.fsdp_states_under(root):
            if _compat.is_root_flag(state) is not None:
                continue  # its lazy init has run: FSDP has fixed its dtypes
            for group in _compat.param_groups_of(state):
                decision = group.__dict__.get(_DECISION_ATTR)
                if decision is None:
                    decision = group.__dict__[_DECISION_ATTR] = GroupDecision(self.strategy, None)
                if decision.strategy.name == "upcast":
                    groups.append(group)
        if not groups:
            return []
        names = names or _param_names(root)
        entries = []
        for group in groups:
            group_entries = _model_param_entries(group, names)
            if any(e.tensor.requires_grad and _compat.local_tensor_of(e.tensor).is_meta for e in group_entries):
                return []  # not loaded yet: a later moment decides (FSDP's lazy init refuses meta parameters)
            entries.append((group, group_entries))
        for group in groups:
            self._decided(group)
        already = any(group.__dict__[_DECISION_ATTR].upcast for group in groups)
        upcast = []
        if already or any(plan_group_dtypes(group_entries).is_mixed for _, group_entries in entries):
            strategy = self.strategy_of(groups[0])
            for group, group_upcast in strategy.upcast_model(entries, _compat.user_class_name(root), group_fqns(root)):
                decision = group.__dict__[_DECISION_ATTR]
                decision.upcast = True
                upcast.extend(group_upcast)
                if decision.layout is not None:  # its lazy init ran (an explicit unshard()): FSDP's dtypes again
                    _compat.redo_group_mp_dtypes(group)
            if upcast:
                _say_installed_late(root, [group for group, _ in entries])
        self._watch_frozen(entries)
        return upcast

    # -- Note [Unfrozen later] ----------------------------------------------------

    def _watch_frozen(self, entries: list[tuple[Any, list[ParamEntry]]]) -> None:
        trainable = [e.tensor.dtype for _, group_entries in entries for e in group_entries if e.tensor.requires_grad]
        widest = _widest_floating(trainable)
        if widest is None:
            return
        for group, group_entries in entries:
            decision = group.__dict__[_DECISION_ATTR]
            for fsdp_param, frozen_dtype in decision.watched:
                if _compat.fsdp_param_is_trainable(fsdp_param):
                    # Unfrozen since an earlier moment: state an optimizer made for it then is in frozen_dtype.
                    _optimizer_state.remember_upcast(fsdp_param, frozen_dtype)
            frozen = [
                e for e in group_entries
                if not e.tensor.requires_grad and e.tensor.dtype != widest and cast_exclusion_reason(e.tensor) is None
            ]
            decision.watched = [
                (e.handle, e.tensor.dtype) for e in frozen if torch.promote_types(e.tensor.dtype, widest) == widest
            ]
            decision.watched_wider = [e.handle for e in frozen if torch.promote_types(e.tensor.dtype, widest) != widest]
            decision.watch_dtype = widest
            if (decision.watched or decision.watched_wider) and not self._watching:
                self._watching = True
                self._patches.wrap(self.internals.FSDPParamGroup, "post_backward", self._wrap_post_backward,
                                   as_decorated=True)

    def _wrap_post_backward(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def post_backward(group: Any, *args: Any) -> Any:
            decision = group.__dict__.get(_DECISION_ATTR)
            if decision is not None and (decision.watched or decision.watched_wider) and fix.active:
                _upcast_unfrozen(group, decision)
            return original(group, *args)

        return post_backward

    @staticmethod
    def strategy_of(group: Any) -> Any:
        return group.__dict__[_DECISION_ATTR].strategy

    def _wrap_root_lazy_init(self, original: Callable) -> Callable:
        fix = self
        is_root_flag = _compat.is_root_flag

        @wraps(original)
        def _lazy_init(state: Any) -> None:
            if is_root_flag(state) is None and fix.active:
                root = _compat.root_module_of(state)
                if root is not None:
                    fix.adopt_groups_built_past_the_hook(root)
                    fix.upcast_model(root)
                    if _compat_dtype.probe_uniform_dtype_check() == "lazy_init":
                        _refuse_preserve_before_group_lazy_init(root)
            return original(state)

        return _lazy_init

    def _wrap_state_dict_entry_point(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def entry_point(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if fix.active:
                fix.upcast_model(model)
            return original(model, *args, **kwargs)

        return entry_point

    def refuse_half_initialised_models(self) -> None:
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
                self._add_module_hook(module, module.register_forward_pre_hook(hook, prepend=True))
                self._refused.add(module)

    # -- hook 1: before sharding ------------------------------------------------

    def _wrap_init(self, original: Callable) -> Callable:
        fix = self

        @wraps(original)
        def __init__(group: Any, *args: Any, **kwargs: Any) -> None:
            if not fix.active:
                return original(group, *args, **kwargs)
            group.__dict__[_BUILT_ATTR] = False  # being built through the hook (``build_group``)
            bound = _compat.bind_param_group_init(original, (group, *args), kwargs)
            params, modules, mp_policy = (bound.arguments[k] for k in ("params", "modules", "mp_policy"))
            # Per-parameter compute dtypes are chosen on the parameters as loaded, before any cast.
            overrides = _compute_dtype.resolve_before_sharding(params, modules, mp_policy)
            if overrides is not None:
                bound.arguments["mp_policy"] = overrides.policy
            original(*bound.args, **bound.kwargs)
            if overrides is not None:
                _compute_dtype.after_sharding(group, overrides)
                if overrides.compute_dtypes and not _compute_dtype.TORCH_HAS_OVERRIDE:
                    _keeper.keep(group)  # its override must outlive uninstall(), as torch 2.15's does
            group.__dict__[_BUILT_ATTR] = True
            fix.hook_state_dicts(group, modules)

        return __init__


def fsdp_roots_of(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Note [Scope of the upcast]: the FSDP roots that own parameters of ``modules``: each top-most module
    with FSDP state (no ``fully_shard``-ed ancestor) whose tree holds one of ``modules`` or lies inside one."""
    return _roots.index.roots_of(modules)


def _wrap_state_init(original: Callable) -> Callable:
    @wraps(original)
    def init(state: Any, *args: Any, **kwargs: Any) -> None:
        original(state, *args, **kwargs)
        _roots.index.register(state)  # Note: cost, in _roots

    return init


def _contains(module: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(sub is inner for sub in module.modules())


def _param_holders(group: Any, modules: tuple) -> list[torch.nn.Module]:
    """The modules that hold the group's parameters as attributes, other than ``modules``."""
    holders, seen = [], {id(m) for m in modules}
    for fsdp_param in group.fsdp_params:
        module = fsdp_param._module_info.module
        if id(module) not in seen:
            seen.add(id(module))
            holders.append(module)
    return holders


def _say_installed_late(root: torch.nn.Module, groups: list) -> None:
    """Note [Installed late]: the upcast of a model sharded before the plugin was installed says so, once."""
    late = [group for group in groups if group.__dict__.get(SHARDED_BEFORE_INSTALL_ATTR) is True]
    if not late:
        return
    for group in groups:
        if SHARDED_BEFORE_INSTALL_ATTR in group.__dict__:
            group.__dict__[SHARDED_BEFORE_INSTALL_ATTR] = "said"
    pg = _compat.group_process_group(late[0])
    if dist.is_available() and dist.is_initialized() and dist.get_rank(pg) != 0:
        return
    logger.warning(
        "torch_fsdp_ext: %s was sharded (fully_shard) before torch_fsdp_ext was installed, and is upcast to fp32 "
        "master weights only now. Weights loaded into it in between (a state dict, a DCP load) went into its "
        "parameters as loaded, so fp32 values were rounded to bfloat16 first, and training differs from "
        "model.float() before fully_shard. Install the plugin before fully_shard and before loading weights "
        "(import torch_fsdp_ext first), or load after an optimizer took the model's parameters.",
        _compat.user_class_name(root),
    )


def _widest_floating(dtypes: list[torch.dtype]) -> torch.dtype | None:
    floating = [d for d in dtypes if d.is_floating_point and d.itemsize > 1]
    return functools.reduce(torch.promote_types, floating) if floating else None


def _upcast_unfrozen(group: Any, decision: GroupDecision) -> None:
    """Note [Unfrozen later], right before the group's reduce-scatter."""
    wider = [p for p in decision.watched_wider if _compat.fsdp_param_is_trainable(p)]
    if wider:
        names = ", ".join(f"{_compat.fsdp_param_name(p, 0)} ({format_dtype(p.sharded_param.dtype)})" for p in wider)
        raise MixedParamDtypeError(
            f"torch_fsdp_ext: {names} became trainable after the model's other trainable parameters were fixed "
            f"as {format_dtype(decision.watch_dtype)}; its gradient cannot be reduced with theirs. Fix: make it "
            "trainable before the first forward (or before torch_fsdp_ext.upcast_now(model)), or cast the model "
            "to one dtype before fully_shard (model.float())."
        )
    unfrozen = [(p, dtype) for p, dtype in decision.watched if _compat.fsdp_param_is_trainable(p)]
    if not unfrozen:
        return
    decision.watched = [(p, dtype) for p, dtype in decision.watched if not _compat.fsdp_param_is_trainable(p)]
    logger.info(
        "torch_fsdp_ext: %s became trainable: now %s master weight(s)",
        ", ".join(_compat.fsdp_param_name(p, 0) for p, _ in unfrozen), format_dtype(decision.watch_dtype),
    )
    _compat.reshard_group(group)  # what post_backward does first when it resharded after backward
    for fsdp_param, frozen_dtype in unfrozen:
        # Note: optimizer state made while it was frozen (Adagrad's, at construction) is in the dtype it
        # had then, even if the user cast it since; the step check compares against that one.
        upcast_sharded_param(group, fsdp_param, decision.watch_dtype, state_dtype_before=frozen_dtype)
    _compat.redo_group_mp_dtypes(group)


# -- hook 2: right before the uniform-dtype check ---------------------------------


def _prepare(group: Any, strategy: Any) -> bool:
    """Hand a mixed sharded group to ``strategy``; True if it goes on with mixed dtypes."""
    params = [ParamEntry(_compat.fsdp_param_name(p, i), p.sharded_param, p) for i, p in enumerate(group.fsdp_params)]
    plan = plan_group_dtypes(params)
    if not plan.is_mixed:
        return False
    if strategy.name == "preserve":
        _refuse_preserve_if_unsupported(repr(_compat.group_name(group)), plan)
    return strategy.at_lazy_init(group, plan, repr(_compat.group_name(group)))


def group_fqns(root: torch.nn.Module) -> Callable[[Any], str]:
    """A param group's name: the FQN of its module under ``root``, ``'<root>'`` for the root's own.

    Note: FSDP names its groups (``_module_fqn``) only in the root's lazy init; a model's upcast
    moment (an optimizer, a state dict) comes earlier, and its messages must still say which group.
    """
    module_names = {id(module): fqn or "<root>" for fqn, module in root.named_modules(remove_duplicate=False)}

    def fqn(group: Any) -> str:
        modules = _compat.group_modules(group)
        return module_names.get(id(modules[0]), "<root>") if modules else _compat.group_name(group)

    return fqn


def _param_names(root: torch.nn.Module) -> dict[int, str]:
    return {id(param): fqn for fqn, param in root.named_parameters(remove_duplicate=False)}


def _model_param_entries(group: Any, names: dict[int, str]) -> list[ParamEntry]:
    """The group's parameters as the model holds them, named by their FQN under the root."""
    entries = []
    for i, fsdp_param in enumerate(group.fsdp_params):
        param = _compat.current_module_param(fsdp_param)
        entries.append(ParamEntry(names.get(id(param)) or _compat.fsdp_param_name(fsdp_param, i), param, fsdp_param))
    return entries


def _refuse_preserve_if_unsupported(group_name: str, plan: Any) -> None:
    """``preserve`` keeps a group mixed through ``_init_mp_dtypes``; some releases check elsewhere too."""
    if _compat_dtype.probe_dtype_check_counts_frozen():
        why = "its _init_mp_dtypes also counts frozen parameters"
    elif _compat_dtype.probe_uniform_dtype_check() == "lazy_init":
        why = "it checks for one dtype in FSDPParamGroup.lazy_init, outside the _init_mp_dtypes that preserve patches"
    else:
        return
    hint = f"dtype_strategy='preserve' is not supported on this torch: {why}. Use dtype_strategy='upcast'."
    raise MixedParamDtypeError(describe_mixed_dtypes(group_name, plan, {}, hint))


def _refuse_preserve_before_group_lazy_init(root: torch.nn.Module) -> None:
    """Where torch's check runs in the group's lazy init, a mixed ``preserve`` group is refused
    here, by this plugin and naming its parameters, before torch's assertion would."""
    names, group_name = _param_names(root), group_fqns(root)
    for state in _compat.fsdp_states_under(root):
        for group in _compat.param_groups_of(state):
            decision = group.__dict__.get(_DECISION_ATTR)
            if decision is None or decision.strategy.name != "preserve":
                continue
            plan = plan_group_dtypes(_model_param_entries(group, names))
            if plan.is_mixed:
                _refuse_preserve_if_unsupported(repr(group_name(group)), plan)


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
            if self.reduce_patches is None and not _compat_dtype.probe_reduce_casts_grads_per_param():
                patches = PatchSet()
                try:
                    _mixed_groups.wrap_reduce_for_mixed_groups(patches)
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
                # Uninstalled: torch's own behaviour, and the compute dtypes of a group built with an override.
                original(group)
                _compute_dtype.at_lazy_init(group)
                return
            if fix is not None:
                _compute_dtype.check_defaults_matched(group)
            modules = _compat.group_modules(group)
            if decision is None and modules and _built_past_the_hook(group):
                fix.adopt_groups_built_past_the_hook(modules[0])  # ``unshard()`` first: no root lazy init yet
            if decision is None and group in fix._undecided:
                # Note [Upcast moment]: a group's lazy init before its root's (``unshard()`` first).
                fix.upcast_model(modules[0])
                decision = group.__dict__.get(_DECISION_ATTR)
            if decision is None:
                decision = group.__dict__[_DECISION_ATTR] = GroupDecision(fix.strategy, None)
            layout = _layout(group)
            if layout != decision.layout:  # first lazy init, or the user changed a dtype since
                decision.stays_mixed = _prepare(group, decision.strategy)
                decision.layout = _layout(group)
            if fix is not None:
                fix.ranks.note_layout(group)
            if decision.stays_mixed:
                _mixed_groups.init_mp_dtypes_of_mixed_group(original, group)
            else:
                _mixed_groups.forget_mixed_group(group)
                if _compat_dtype.probe_dtype_check_counts_frozen():
                    _init_mp_dtypes_trainable_only(original, group)
                else:
                    original(group)
            _compute_dtype.at_lazy_init(group)
            if decision.stays_mixed or _mixed_groups.is_mixed_group(group):  # preserve, or several compute dtypes
                keeper.keep(group)

        return _init_mp_dtypes


def _upcast_before_state_dict(fix_ref: weakref.ref, module: torch.nn.Module, *args: Any) -> None:
    """``state_dict()`` / ``load_state_dict()`` pre-hook of an FSDP module: Note [Upcast moment].

    Note: once its model is decided, only the module's own tree is looked at again (a dtype changed
    since): a ``load_state_dict(assign=True)`` through the root runs this hook of each block after the
    blocks before it took their new tensors, which must stay as assigned until the next moment of the model.
    """
    fix = fix_ref()
    state = _compat.fsdp_state_of(module)
    if fix is None or not fix.active or _compat.is_root_flag(state) is not None:
        return
    if any(group in fix._undecided for group in _compat.param_groups_of(state)):
        fix.upcast_model(module)  # Note [Scope of the upcast]: its whole model
    else:
        fix.upcast_root(module)


def _upcast_before_load_into(fix_ref: weakref.ref, group_ref: weakref.ref, module: torch.nn.Module, *args: Any) -> None:
    """``load_state_dict()`` pre-hook of a module holding a group's parameters, while its model is undecided."""
    fix, group = fix_ref(), group_ref()
    if fix is not None and fix.active and group is not None and group in fix._undecided:
        fix.upcast_model(module)


def _reindex_after_load(fix_ref: weakref.ref, group_ref: weakref.ref, module: torch.nn.Module, *args: Any) -> None:
    """``load_state_dict()`` post-hook of a module holding an undecided group's parameters: ``assign=True``
    put new parameter objects in place, which an optimizer then takes."""
    fix, group = fix_ref(), group_ref()
    if fix is not None and group is not None and group in fix._undecided:
        fix._index_params(group)


def _built_past_the_hook(group: Any) -> bool:
    """Note [Built past the hook]: built while the fix was installed, not through its hook."""
    return not group.__dict__.get(_BUILT_ATTR) and _EXISTED_ATTR not in group.__dict__


def _refuse_built_past_the_hook(root: torch.nn.Module, groups: list, init: Callable) -> None:
    """Note [Built past the hook]: one error naming the groups and what stands in the constructor's place."""
    name = group_fqns(root)
    current = _compat.describe_function(init)
    wrappers = [w for w in _compat.foreign_functions_before_torch(init, "__init__") if w != current]
    raise MixedParamDtypeError(
        f"torch_fsdp_ext: FSDP2 group(s) {', '.join(repr(name(g)) for g in groups)} of "
        f"{_compat.user_class_name(root)} were built by fully_shard without the plugin's FSDPParamGroup.__init__ "
        f"hook, although the plugin was installed: a wrapper that calls torch's own constructor directly "
        f"(FSDPParamGroup.__init__ is now {current}{', then ' + ', '.join(wrappers) if wrappers else ''}). The model's "
        "trainable parameters mix dtypes, and the plugin cannot tell whether weights loaded into it since were "
        "rounded to its loaded dtypes, so it does not train it differently from model.float() in silence. Fix: "
        "apply that wrapper before import torch_fsdp_ext, or let it call the FSDPParamGroup.__init__ it finds on "
        "the class; or cast the model to one dtype before fully_shard (model.float())."
    )


def _refuse_forward(message: str, module: torch.nn.Module, args: tuple) -> None:
    raise RuntimeError(message)


# Note: kept across ``importlib.reload`` (as ``_install`` keeps what is installed), so that
# the wrappers in place are found and restored, not wrapped a second time.
_keeper: GroupKeeper = globals().get("_keeper") or GroupKeeper()
