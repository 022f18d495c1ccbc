"""Per-parameter compute dtype inside one FSDP2 group (``param_dtype_override_fn``).

torch 2.15 added ``MixedPrecisionPolicy(param_dtype_override_fn=fn)``: ``fn(param)``
returns ``None``, ``param_dtype`` or the parameter's original dtype, and a parameter
for which it returns its original dtype is all-gathered and computes in that dtype
(fp32 norms in a bf16 group) without an FSDP unit of its own. This module gives the
same field, semantics and errors on every release (torch's class where it has the
field, a compatible subclass elsewhere), and the common case without writing a
function: ``compute_in_loaded_dtype(model, [LlamaRMSNorm, "lm_head"])`` or the
``TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE`` environment variable; the selector ``"auto"``
reads a transformers model's own lists of modules kept in fp32 (Note [auto]).

The dtype fix (``_fix.py``) calls three steps:

- ``resolve_before_sharding``: in ``FSDPParamGroup.__init__`` before the dtype fix
  casts anything, so that ``fn`` sees each parameter as the user loaded it;
- ``after_sharding``: gives each ``FSDPParam`` its own policy;
- ``at_lazy_init``: after ``_init_mp_dtypes``, on releases before 2.15, sets each
  overridden ``FSDPParam.param_dtype``.

Note: nothing else is needed for the all-gather. FSDP2 all-gathers a group whose
all-gather inputs mix dtypes as bytes (``_get_all_gather_input_metadatas`` falls back
to ``uint8``; read in 2.12.1, 2.13.0 and 2.15.0), copies each parameter out in its own dtype, and its
fast-path foreach cast skips parameters without a ``param_dtype``. One all-gather
per group, as before; groups without an override are not touched at all.
Before 2.15 the reduce-scatter takes one gradient dtype: ``_compat`` reduces such
a group in its widest dtype (``reduce_dtype`` when set) and gives each parameter
its gradient in its own dtype.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import operator
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .. import _compat, _env
from . import _loaded_dtypes, _mixed_groups, _roots
from ._plan import format_dtype, param_names

ENV_VAR = "TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE"

# Note: a torch without FSDP2 still imports the plugin (it then installs nothing);
# only making this policy is an error there.
try:
    _TorchMixedPrecisionPolicy = _compat.fsdp2_api().MixedPrecisionPolicy
    _NO_FSDP2: ImportError | None = None
except ImportError as error:
    _TorchMixedPrecisionPolicy, _NO_FSDP2 = None, error

# Note: probed from the dataclass fields, not the version: 2.15 is the first release with it.
TORCH_HAS_OVERRIDE = _TorchMixedPrecisionPolicy is not None and "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(_TorchMixedPrecisionPolicy)
}

# Set on an FSDPParam whose compute dtype an override chose: the dtype it computes in.
_COMPUTE_ATTR = "_torch_fsdp_ext_compute_dtype"


if _TorchMixedPrecisionPolicy is None:

    class MixedPrecisionPolicy:  # type: ignore[no-redef]
        """Stands in for FSDP2's policy on a torch without FSDP2: making one names the cause."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                f"torch_fsdp_ext.MixedPrecisionPolicy needs FSDP2 (fully_shard), and torch {torch.__version__} "
                f"has none here: {_NO_FSDP2}"
            )

elif TORCH_HAS_OVERRIDE:
    MixedPrecisionPolicy = _TorchMixedPrecisionPolicy
else:

    @dataclass(frozen=True)
    class MixedPrecisionPolicy(_TorchMixedPrecisionPolicy):  # type: ignore[no-redef]
        """torch's ``MixedPrecisionPolicy`` with 2.15's ``param_dtype_override_fn`` (kw-only).

        ``param_dtype_override_fn(param)`` is called once per parameter when
        ``fully_shard`` builds its group, on the parameter as it was loaded. It returns
        ``None`` or ``param_dtype`` (compute in ``param_dtype``) or the parameter's
        original dtype (all-gather and compute in it); anything else is a ``ValueError``.
        Forward inputs are still cast to ``param_dtype``. Needs the plugin's dtype fix
        installed (the default on import); without it, making the policy is an error.
        """

        # Note: keyword-only as in torch 2.15 where dataclasses support it (Python >= 3.10).
        param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
            default=None, **({"kw_only": True} if sys.version_info >= (3, 10) else {})
        )

        def __post_init__(self) -> None:
            parent = getattr(super(), "__post_init__", None)
            if parent is not None:
                parent()
            if self.param_dtype_override_fn is not None:
                _require_dtype_fix()

        def _resolve_for_param(self, param: nn.Parameter) -> "MixedPrecisionPolicy":
            if self.param_dtype_override_fn is None:
                return self
            name = f"a parameter of shape {tuple(param.shape)}"
            param_dtype = _resolve(self.param_dtype_override_fn, self, param, name)
            return dataclasses.replace(self, param_dtype=param_dtype, param_dtype_override_fn=None)


# Whether the dtype fix is active, and if not why: set by ``_install`` at every install() and
# uninstall() (this module is imported by the fix, so it is told, never asks).
_dtype_fix_inactive_reason: str | None = "not installed"


def note_dtype_fix(inactive_reason: str | None) -> None:
    """``_install``: the dtype fix is now active (None), or not, for this reason."""
    global _dtype_fix_inactive_reason
    _dtype_fix_inactive_reason = inactive_reason


def _require_dtype_fix() -> None:
    """The backported override works through the dtype fix's hooks; without them FSDP2 ignores it.

    Note: checked when the policy is made, so that a policy never goes silently off
    (``TORCH_FSDP_EXT_DISABLE=1``, a torch the fix stands aside on, before ``install()``).
    Groups built while the fix was active keep their overrides after ``uninstall()``
    (``_fix.GroupKeeper``).
    """
    if _dtype_fix_inactive_reason is None:
        return
    raise ValueError(
        f"torch_fsdp_ext: MixedPrecisionPolicy(param_dtype_override_fn=...) needs the plugin's dtype fix on torch "
        f"{torch.__version__} (no native param_dtype_override_fn), and the fix is not active: "
        f"{_dtype_fix_inactive_reason}. FSDP2 would ignore the override and every "
        "parameter would compute in param_dtype. Fix: unset TORCH_FSDP_EXT_DISABLE or call "
        "torch_fsdp_ext.install() before making the policy."
    )


def has_overrides(group: Any) -> bool:
    """Some parameter of ``group`` computes in a dtype an override chose."""
    return any(_COMPUTE_ATTR in p.__dict__ for p in group.fsdp_params)


def override_fn_of(policy: Any) -> Callable | None:
    return getattr(policy, "param_dtype_override_fn", None)


# ---------------------------------------------------------------------------
# The common case: "these modules compute in their loaded dtype"
# ---------------------------------------------------------------------------

Selector = "type[nn.Module] | str"


def _matches(selector: Any, fqn: str, module: nn.Module) -> bool:
    """A class matches its instances; a string matches a class name, an FQN glob, or one FQN component."""
    if isinstance(selector, type):
        return isinstance(module, selector)
    if selector == AUTO:  # reserved: transformers' keep-in-fp32 lists (Note [auto]), never a name
        return False
    return (
        any(cls.__name__ == selector for cls in type(module).__mro__)
        or fnmatch.fnmatchcase(fqn, selector)
        or selector in fqn.split(".")  # transformers' _keep_in_fp32_modules convention
    )


def _check_selectors(selectors: Iterable[Any]) -> tuple[Any, ...]:
    selectors = (selectors,) if isinstance(selectors, (str, type)) else tuple(selectors)
    for selector in selectors:
        if not (isinstance(selector, str) and selector.strip()) and not (
            isinstance(selector, type) and issubclass(selector, nn.Module)
        ):
            raise TypeError(
                "torch_fsdp_ext: compute_in_loaded_dtype takes nn.Module classes, class names or module FQN "
                f"patterns, got {selector!r}"
            )
    return selectors


class LoadedDtypeModules:
    """A ``param_dtype_override_fn``: parameters of the matched modules compute in their loaded dtype.

    Made by ``compute_in_loaded_dtype``. Each matched module also runs as it would as its
    own FSDP unit with an fp32 policy and ``output_dtype`` = the dtype around it: its
    floating inputs are cast to its loaded dtype, its floating outputs back to the dtype
    its inputs came in (``_add_boundary_casts``), with or without the plugin.
    """

    def __init__(self, modules: dict[nn.Module, torch.dtype]) -> None:
        self.modules = modules  # matched module -> the dtype it computes in
        self._dtypes = {id(p): dtype for m, dtype in modules.items() for p in m.parameters()}
        for module, dtype in modules.items():
            _add_boundary_casts(module, dtype)

    def __call__(self, param: nn.Parameter) -> torch.dtype | None:
        return self._dtypes.get(id(param))


def _module_dtype(fqn: str, module: nn.Module) -> torch.dtype | None:
    dtypes = {p.dtype for p in module.parameters() if p.dtype.is_floating_point}
    if len(dtypes) > 1:
        listing = ", ".join(f"{fqn}.{n} ({format_dtype(p.dtype)})" for n, p in module.named_parameters())
        raise ValueError(
            f"torch_fsdp_ext: module {fqn} ({type(module).__name__}) was selected to compute in its loaded dtype "
            f"but its parameters have several: {listing}. Fix: select its submodules instead."
        )
    return next(iter(dtypes), None)


def _select(root: nn.Module, selectors: tuple[Any, ...], prefix: str = "") -> tuple[dict, set]:
    """Matched modules (outermost; -> their dtype) and the selectors that matched something."""
    modules: dict[nn.Module, torch.dtype] = {}
    used: set[int] = set()
    covered: set[int] = set()
    for fqn, module in root.named_modules(prefix=prefix):
        if id(module) in covered:
            continue
        hits = [i for i, s in enumerate(selectors) if _matches(s, fqn, module)]
        if not hits:
            continue
        used.update(hits)
        dtype = _module_dtype(fqn or "<root>", module)
        covered.update(id(m) for m in module.modules())
        if dtype is not None:
            modules[module] = dtype
    return modules, used


# Note [auto]. transformers declares on a model the modules its checkpoints keep in fp32:
# ``_keep_in_fp32_modules`` (kept in fp32 when loading in fp16) and
# ``_keep_in_fp32_modules_strict`` (in fp16 and bf16). Their entries are patterns
# searched in parameter names, dot-separated components ("wo", "gate.weight",
# "layers.*.router"). The selector ``"auto"`` selects the module holding each parameter
# an entry names, where that module was loaded in fp32: exactly the modules the loader
# kept in fp32, each then computing in fp32 with casts at its boundary. Opt-in, not
# automatic: under a bf16 policy a selected module computes in fp32 instead of bf16 and
# adds two casts, and a model that trains without the plugin must train the same with it.
AUTO = "auto"
KEEP_IN_FP32_LISTS = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")


def keep_in_fp32_entries(model: nn.Module) -> tuple[str, ...]:
    """The entries of transformers' two keep-in-fp32 lists of ``model`` itself (empty for other models)."""
    entries: set[str] = set()
    for attr in KEEP_IN_FP32_LISTS:
        value = getattr(model, attr, None)
        if isinstance(value, (list, tuple, set, frozenset)):
            entries.update(entry for entry in value if isinstance(entry, str) and entry)
    return tuple(sorted(entries))


def _entry_pattern(entry: str) -> re.Pattern:
    """A keep-in-fp32 entry as transformers searches it: whole name components, ``*`` within one."""
    return re.compile(r"(?:^|\.)" + re.escape(entry).replace(r"\*", r"[^.]*") + r"(?:\.|$)")


def _select_kept_in_fp32(
    root: nn.Module, loaded_dtype: Callable[[nn.Parameter], torch.dtype] = operator.attrgetter("dtype")
) -> tuple[dict[nn.Module, torch.dtype], bool]:
    """``"auto"``: the fp32-loaded modules the keep-in-fp32 lists in ``root``'s tree name; whether any list exists.

    ``loaded_dtype``: each parameter's dtype as loaded (the plugin's upcast may have changed it since).
    """
    selected: dict[nn.Module, torch.dtype] = {}
    declared = False
    for owner in root.modules():
        entries = keep_in_fp32_entries(owner)
        if not entries:
            continue
        declared = True
        patterns = [_entry_pattern(entry) for entry in entries]
        for fqn, module in owner.named_modules():
            names = [f"{fqn}.{name}" if fqn else name for name, _ in module.named_parameters(recurse=False)]
            if module not in selected and any(p.search(name) for p in patterns for name in names):
                dtypes = {loaded_dtype(p) for p in module.parameters() if p.dtype.is_floating_point}
                if dtypes == {torch.float32}:
                    selected[module] = torch.float32
    return selected, declared


def compute_in_loaded_dtype(model: nn.Module, modules: Iterable[Any]) -> LoadedDtypeModules:
    """A ``param_dtype_override_fn`` that keeps the selected modules computing in their loaded dtype.

    ``modules``: ``nn.Module`` classes, class names, FQN globs (``"layers.*.norm"``) or FQN
    components (transformers' ``model._keep_in_fp32_modules``). Call it on the model as
    loaded (before ``fully_shard``) and pass the result as
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=...)``.
    A selector that matches no module is an error.
    """
    selectors = _check_selectors(modules)
    matched, used = _select(model, selectors)
    unused = [s for i, s in enumerate(selectors) if i not in used and s != AUTO]
    if unused:
        raise ValueError(_nothing_matched(unused, model))
    if AUTO in selectors:
        kept, declared = _select_kept_in_fp32(model)
        if not declared:
            raise ValueError(_no_keep_in_fp32_lists(type(model).__name__))
        matched.update({m: d for m, d in kept.items() if not any(m in outer.modules() for outer in matched)})
    return LoadedDtypeModules(matched)


def _no_keep_in_fp32_lists(where: str) -> str:
    return (
        f"torch_fsdp_ext: compute_in_loaded_dtype 'auto': {where} declares no _keep_in_fp32_modules or "
        "_keep_in_fp32_modules_strict (transformers' lists of modules kept in fp32). Name the modules instead, "
        "e.g. LlamaRMSNorm."
    )


def _no_keep_in_fp32_lists_on_model(model: str) -> str:
    return (
        f"torch_fsdp_ext: {_setting_as(AUTO)} reads the modules to keep in fp32 from transformers' "
        f"_keep_in_fp32_modules and _keep_in_fp32_modules_strict, which model {model} and every module in it "
        f"leave empty, so name the modules instead, as in {_setting_as('LlamaRMSNorm')}."
    )


def _selector_name(selector: Any) -> str:
    return selector.__name__ if isinstance(selector, type) else repr(selector)


def _nothing_matched(unused: list, model: nn.Module | None) -> str:
    classes = sorted({type(m).__name__ for m in model.modules()}) if model is not None else []
    known = f" Module classes in the model: {', '.join(classes)}." if classes else ""
    return (
        f"torch_fsdp_ext: compute_in_loaded_dtype: {', '.join(_selector_name(s) for s in unused)} matched no "
        f"module.{known} Selectors are nn.Module classes, class names, FQN globs or FQN components."
    )


# Selectors from TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE / ``run.py --compute-in-loaded-dtype``,
# applied to every group whose policy has no override of its own; where they came from, for errors.
_default_selectors: tuple[str, ...] = ()
_matched_defaults: set[int] = set()
LAUNCHER_OPTION = "--compute-in-loaded-dtype"
_default_setting = ENV_VAR  # or LAUNCHER_OPTION


def set_default_selectors(selectors: Iterable[str] | str | None, source: str = ENV_VAR) -> None:
    """Modules that compute in their loaded dtype in every group without an override ("" or None: none).

    ``source``: the setting the user gave them with (``ENV_VAR`` or ``LAUNCHER_OPTION``), named in errors.
    """
    global _default_selectors, _default_setting
    if isinstance(selectors, str):
        selectors = [s.strip() for s in selectors.split(",") if s.strip()]
    _default_selectors = _check_selectors(selectors or ())
    _matched_defaults.clear()
    _default_setting = source


def _setting_as(value: str) -> str:
    """The user's setting of the default selectors with ``value``, as they wrote it."""
    return f"{_default_setting}{' ' if _default_setting == LAUNCHER_OPTION else '='}{value}"


def default_selectors() -> tuple[str, ...]:
    return _default_selectors


def selectors_from_env() -> list[str] | None:
    """The variable's comma-separated selectors; None when unset or empty.

    A value that names nothing (``",,,"``) raises: it asked for fp32 norms and would
    give none.
    """
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    selectors = [s.strip() for s in raw.split(",") if s.strip()]
    if not selectors:
        raise _env.SettingError(
            f"torch_fsdp_ext: {ENV_VAR}={raw!r} names no module. Give comma-separated module class names or FQN "
            "patterns (e.g. LlamaRMSNorm,model.norm), or leave it unset."
        )
    return selectors


# ---------------------------------------------------------------------------
# Steps called by the dtype fix
# ---------------------------------------------------------------------------


@dataclass
class GroupOverrides:
    """What ``resolve_before_sharding`` found for one group: the compute dtype per parameter index."""

    policy: Any  # the group's policy, without the override function
    compute_dtypes: dict[int, torch.dtype]
    own: bool  # the override is the policy's own, not the default selectors'


def resolve_before_sharding(params: list[nn.Parameter], modules: tuple, mp_policy: Any) -> GroupOverrides | None:
    """Call the group's override on each parameter as loaded; None for a group without one."""
    fn = override_fn_of(mp_policy)
    if fn is None and _default_selectors:
        # "auto" waits for the group's lazy init (``resolve_auto``): the lists sit on the model's root,
        # which fully_shard reaches last.
        selected: dict[nn.Module, torch.dtype] = {}
        for module in modules:
            found, used = _select(module, _default_selectors)
            selected.update(found)
            _matched_defaults.update(used)
        fn = LoadedDtypeModules(selected) if selected else None
    if fn is None:
        return None
    base = dataclasses.replace(mp_policy, param_dtype_override_fn=None) if override_fn_of(mp_policy) else mp_policy
    names = param_names(modules)
    compute_dtypes = {}
    for index, param in enumerate(params):
        dtype = _resolve(fn, base, param, names.get(id(param), f"<param {index}>"))
        if dtype != base.param_dtype:
            compute_dtypes[index] = dtype
    return GroupOverrides(base, compute_dtypes, override_fn_of(mp_policy) is not None)


# Set on a param group once ``"auto"`` was resolved for its model; on one whose policy has its own override.
_AUTO_ATTR = "_torch_fsdp_ext_auto_resolved"
_OWN_OVERRIDE_ATTR = "_torch_fsdp_ext_own_override"


def _model_root(group: Any) -> nn.Module | None:
    """The outermost module ``fully_shard`` was applied to that holds ``group``: what the model's lists sit on."""
    modules = _compat.group_modules(group)
    return _roots.index.root_of(modules[0]) if modules else None


def resolve_auto(group: Any) -> None:
    """``"auto"`` among the default selectors: at the group's lazy init, select in its whole model.

    Note [auto where the lists live]. transformers keeps its lists on the model (the root, or a
    model inside a PEFT wrapper), and accelerate's ``TRANSFORMER_BASED_WRAP`` gives the embedding,
    each decoder layer and the head groups of their own before it shards the root, which is left
    with no parameters and so with no group: at a group's construction its model's lists are out
    of reach. At the first lazy init every module of the model has been sharded, so the lists are
    read from the outermost sharded module's tree, which holds each group's module and all its
    ancestors up to that root. Parameters are judged by their loaded dtype (``_loaded_dtypes``
    remembers the dtype of each one the plugin upcast since).
    """
    if AUTO not in _default_selectors or group.__dict__.get(_AUTO_ATTR):
        return
    root = _model_root(group)
    if root is None:
        return
    groups = [g for state in _compat.fsdp_states_under(root) for g in _compat.param_groups_of(state)]
    upcast = _loaded_dtypes._changed_dtypes(root)
    selected, declared = _select_kept_in_fp32(root, lambda param: upcast.get(id(param), param.dtype))
    if not declared:
        raise ValueError(_no_keep_in_fp32_lists_on_model(_compat.user_class_name(root)))
    _matched_defaults.add(_default_selectors.index(AUTO))
    fn = LoadedDtypeModules(selected)
    for g in groups:
        g.__dict__[_AUTO_ATTR] = True
        if g.__dict__.get(_OWN_OVERRIDE_ATTR):
            continue  # a group whose policy has its own override: the defaults do not apply
        for fsdp_param in g.fsdp_params:
            dtype = fn(_compat.current_module_param(fsdp_param))
            if dtype is not None and dtype != _compat.param_mp_policy(g, fsdp_param).param_dtype:
                compute_in(g, fsdp_param, dtype)


def _resolve(fn: Callable, policy: Any, param: nn.Parameter, name: str) -> torch.dtype | None:
    """2.15's ``_resolve_for_param`` rule, with the parameter named in the error."""
    override = fn(param)
    if override is None:
        return policy.param_dtype
    loaded = format_dtype(param.dtype)
    if not isinstance(override, torch.dtype):
        raise ValueError(
            f"torch_fsdp_ext: param_dtype_override_fn must return a torch.dtype or None but got "
            f"{type(override).__name__} ({override!r}) for {name} ({loaded})"
        )
    if override not in (policy.param_dtype, param.dtype):
        raise ValueError(
            f"torch_fsdp_ext: param_dtype_override_fn must return None, param_dtype "
            f"({policy.param_dtype}), or the parameter's original dtype ({param.dtype}) but got {override} "
            f"for {name} ({loaded})"
        )
    return override


def after_sharding(group: Any, overrides: GroupOverrides) -> None:
    """Give each overridden FSDPParam its own policy (read by 2.15's lazy init) and mark it."""
    if overrides.own:
        group.__dict__[_OWN_OVERRIDE_ATTR] = True
    for index, dtype in overrides.compute_dtypes.items():
        fsdp_param = group.fsdp_params[index]
        fsdp_param.mp_policy = dataclasses.replace(overrides.policy, param_dtype=dtype)
        fsdp_param.__dict__[_COMPUTE_ATTR] = dtype


def compute_in(group: Any, fsdp_param: Any, dtype: torch.dtype) -> None:
    """Before the group's lazy init: ``fsdp_param`` is all-gathered and computes in ``dtype``."""
    fsdp_param.mp_policy = dataclasses.replace(_compat.param_mp_policy(group, fsdp_param), param_dtype=dtype)
    fsdp_param.__dict__[_COMPUTE_ATTR] = dtype


def at_lazy_init(group: Any) -> None:
    """Before 2.15: the overridden parameters' ``param_dtype``, the plugin's masters' reduce dtype, and one
    reduce for mixed gradient dtypes."""
    overridden = [p for p in group.fsdp_params if _COMPUTE_ATTR in p.__dict__]
    if not TORCH_HAS_OVERRIDE:
        for fsdp_param in overridden:
            dtype = fsdp_param.__dict__[_COMPUTE_ATTR]
            fsdp_param.param_dtype = None if dtype == fsdp_param.orig_dtype else dtype
        _masters_reduce_in_their_dtype(group)
    if not overridden:
        return
    _check_one_cast_dtype(group)
    if TORCH_HAS_OVERRIDE:
        return  # 2.15 reduces mixed gradient dtypes itself
    trainable = [p for p in group.fsdp_params if _compat.fsdp_param_is_trainable(p)]
    compute = {p: p.param_dtype or p.orig_dtype for p in trainable}
    if len(set(compute.values())) < 2 or _mixed_groups.is_mixed_group(group):
        return  # one gradient dtype, or a preserve group already reduced in its widest dtype
    # Note: with reduce_dtype=None a release before 2.15 reduces each gradient in the
    # dtype it was computed in; one reduce in the widest dtype, with each gradient
    # rounded to its compute dtype, gives the same for the parameters the override
    # leaves alone as without it.
    reduce_dtype = group.mp_policy.reduce_dtype
    round_through = {} if reduce_dtype is not None else {p: c for p, c in compute.items() if p.reduce_dtype is None}
    _mixed_groups.mark_mixed_compute_group(group, reduce_dtype, round_through)


def _masters_reduce_in_their_dtype(group: Any) -> None:
    """Before 2.15: in a group where the plugin made master weights (upcast from a narrower loaded dtype), under
    a policy without ``reduce_dtype``, each parameter computed in a narrower dtype accumulates and reduces in
    its own dtype.

    Note: 2.15 makes every such gradient in the parameter's own dtype when the policy sets no
    reduce dtype (``FSDPParam.unsharded_grad_dtype``); a release before keeps it in the compute
    dtype, so an fp32 master accumulated over micro-batches without sync would sum in bf16. The
    whole group takes 2.15's rule, so that its gradients keep one dtype; a group the plugin did
    not change keeps its release's rule.
    """
    if not any(_loaded_dtypes.loaded_dtype_of(p) is not None for p in group.fsdp_params):
        return
    for fsdp_param in group.fsdp_params:
        if (
            fsdp_param.reduce_dtype is None and fsdp_param.param_dtype is not None
            and fsdp_param.param_dtype.itemsize < fsdp_param.orig_dtype.itemsize
        ):
            fsdp_param.reduce_dtype = fsdp_param.orig_dtype


def _check_one_cast_dtype(group: Any) -> None:
    """FSDP's all-gather copy-in casts every parameter with a ``param_dtype`` to the first one's."""
    cast = [p for p in group.fsdp_params if p.param_dtype is not None]
    if len({p.param_dtype for p in cast}) > 1:
        listing = ", ".join(
            f"{_compat.fsdp_param_fqn(p)} ({format_dtype(p.orig_dtype)} -> {format_dtype(p.param_dtype)})" for p in cast
        )
        raise ValueError(
            f"torch_fsdp_ext: FSDP2 group {_compat.group_name(group)!r} would cast parameters to several compute "
            f"dtypes: {listing}. A loaded dtype other than param_dtype can only be kept where the parameter is "
            "stored in it. Fix: install(dtype_strategy='preserve'), or make param_dtype that dtype."
        )


def check_defaults_matched(group: Any = None) -> None:
    """At a group's lazy init: ``"auto"`` resolved for its model, and every other selector of the
    environment / launcher matched a module somewhere."""
    if group is not None:
        resolve_auto(group)
    unused = [s for i, s in enumerate(_default_selectors) if i not in _matched_defaults and s != AUTO]
    if unused:
        raise ValueError(
            _nothing_matched(unused, None).replace("compute_in_loaded_dtype", _default_setting, 1)
            + " No FSDP2 group built so far holds such a module."
        )


def compute_dtype_of(fsdp_param: Any) -> torch.dtype | None:
    """The compute dtype an override gave this FSDPParam, or None."""
    return fsdp_param.__dict__.get(_COMPUTE_ATTR)


# ---------------------------------------------------------------------------
# Module boundary casts of the common case
# ---------------------------------------------------------------------------

_BOUNDARY_ATTR = "_torch_fsdp_ext_boundary_casts"


def _add_boundary_casts(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Floating inputs to ``compute_dtype``, floating outputs back to the dtype the inputs came in.

    What the module would do as its own FSDP unit with ``param_dtype=compute_dtype`` and
    ``output_dtype`` = the dtype around it, so that a norm computing in fp32 hands bf16
    on to the bf16 layer after it.

    Note: registered by the override function itself (``LoadedDtypeModules``), not by the
    plugin at ``fully_shard``: the same policy then computes the same with torch 2.15's
    native ``param_dtype_override_fn``, with or without the plugin. Plain module hooks,
    traced by torch.compile like the module's own code; they run again in
    activation-checkpoint recompute, as the forward did.
    """
    if _BOUNDARY_ATTR in module.__dict__:
        return
    module.__dict__[_BOUNDARY_ATTR] = compute_dtype
    to_compute, cast_to = _compat.floating_tensor_cast(compute_dtype), _compat.floating_tensor_cast_to()
    first_floating_dtype = _compat.floating_dtype_finder()
    input_dtypes: list[torch.dtype | None] = []  # one entry per call in flight (nested or recursive calls)

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        input_dtypes.append(first_floating_dtype((args, kwargs)))
        return to_compute(args), to_compute(kwargs)

    def cast_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
        dtype = input_dtypes.pop()
        return output if dtype is None else cast_to(dtype, output)

    module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    module.register_forward_hook(cast_outputs)
