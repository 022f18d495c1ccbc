"""The torch-version layer: the only module that knows torch's private FSDP2 and
activation-checkpoint internals.

Every private symbol the fixes touch is listed in ``PRIVATE_SYMBOLS`` and resolved
here, once. Supporting a new torch release means editing this file only.

Note: where behaviour differs between releases we *probe* it (call the private
function on a tiny stand-in object and look at what it did) instead of comparing
version strings. A probe that cannot run answers ``None`` ("unknown"); callers
treat unknown conservatively.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import operator
import os
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# Package that holds FSDP2's implementation, newest location first.
#   torch >= 2.6: torch.distributed.fsdp._fully_shard
#   torch 2.5:    torch.distributed._composable.fsdp
FSDP2_PACKAGES = (
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
)

# (name used in this package, module inside the FSDP2 package or absolute module, attribute)
PRIVATE_SYMBOLS: tuple[tuple[str, str, str], ...] = (
    ("FSDPParamGroup", "._fsdp_param_group", "FSDPParamGroup"),
    ("FSDPParam", "._fsdp_param", "FSDPParam"),
    # The module object: its ``foreach_reduce`` name is what ``FSDPParamGroup.post_backward`` calls.
    ("fsdp_param_group_module", "", "_fsdp_param_group"),
    ("FSDPState", "._fsdp_state", "FSDPState"),
    ("TrainingState", "._fsdp_common", "TrainingState"),
    ("cast_fp_tensor", "._fsdp_common", "_cast_fp_tensor"),
    ("MixedPrecisionPolicy", "._fsdp_api", "MixedPrecisionPolicy"),
    ("apply_to_tensors", "torch.distributed.utils", "_apply_to_tensors"),
    ("to_kwargs", "torch.distributed.utils", "_to_kwargs"),
    ("checkpoint_hook", "torch.utils.checkpoint", "_checkpoint_hook"),
    ("recomputation_hook", "torch.utils.checkpoint", "_recomputation_hook"),
    ("CheckpointFrame", "torch.utils.checkpoint", "_CheckpointFrame"),
    ("module_state_mapping", "torch.distributed._composable_state", "_module_state_mapping"),
)

# The symbols above that each fix needs: one missing sets aside only the fixes that need it.
FIX_SYMBOLS: dict[str, frozenset[str]] = {
    "dtype": frozenset({
        "FSDPParamGroup", "FSDPParam", "fsdp_param_group_module", "FSDPState", "MixedPrecisionPolicy",
        "module_state_mapping",
    }),
    "recompute": frozenset({
        "FSDPState", "TrainingState", "cast_fp_tensor", "MixedPrecisionPolicy", "apply_to_tensors", "to_kwargs",
        "checkpoint_hook", "recomputation_hook", "CheckpointFrame", "module_state_mapping",
    }),
    # The reduce fix wraps foreach_reduce only; without FSDPParamGroup its frozen-first-forward probe answers None.
    "reduce": frozenset({"fsdp_param_group_module", "MixedPrecisionPolicy"}),
}

# Methods that the fixes wrap, by the name used above.
WRAPPED_METHODS: tuple[tuple[str, str], ...] = (
    ("FSDPParamGroup", "__init__"),
    ("FSDPParamGroup", "_init_mp_dtypes"),
    ("FSDPParamGroup", "post_backward"),
    ("FSDPParam", "to_sharded_dtensor"),
    ("fsdp_param_group_module", "foreach_reduce"),
    ("FSDPState", "init"),
    ("FSDPState", "_lazy_init"),
    ("FSDPState", "_pre_forward"),
    ("FSDPState", "_post_forward"),
    ("checkpoint_hook", "__init__"),
    ("checkpoint_hook", "__enter__"),
    ("checkpoint_hook", "__exit__"),
    ("recomputation_hook", "__init__"),
    ("recomputation_hook", "__enter__"),
    ("recomputation_hook", "__exit__"),
)

# Note: FSDP2 marks its forward hooks (``FSDPState._pre_forward`` / ``_post_forward``)
# for dynamo with a decorator: ``disable_if_config_true`` in ``_fsdp_state`` up to
# 2.11 (skipped unless ``torch._dynamo.config.skip_fsdp_hooks`` is False: traceable
# FSDP2), ``_dynamo_disable`` in ``_fsdp_common`` from 2.12 (always skipped). A plain
# function put in their place is traced instead: a graph break where it calls the
# original, guards on what it reads, a recompile per module class. The wrapper is
# therefore decorated with the original's own decorator, found by ``dynamo_decorator``.

# Device types whose root pre-forward moves inputs onto the FSDP device
# (``FSDPState._root_pre_forward``); on CPU nothing is moved.
_INPUT_MOVING_DEVICE_TYPES = frozenset({"cuda", "hpu", "xpu", "mtia"})


@dataclass
class TorchInternals:
    """Resolved private torch symbols, or the reason they could not be resolved."""

    fsdp_package: str | None = None
    symbols: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    missing_owners: list[str] = field(default_factory=list)  # per ``missing`` entry: the symbol it belongs to
    hidden: list[str] = field(default_factory=list)  # torch's function behind a foreign wrapper it cannot follow
    hidden_owners: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing

    def note_missing(self, what: str, owner: str) -> None:
        self.missing.append(what)
        self.missing_owners.append(owner)

    def note_hidden(self, what: str, owner: str) -> None:
        """``owner``'s function is there, but behind another library's wrapper the plugin cannot see through."""
        self.hidden.append(what)
        self.hidden_owners.append(owner)

    def hidden_for(self, fix: str) -> list[str]:
        return [what for what, owner in zip(self.hidden, self.hidden_owners) if owner in FIX_SYMBOLS[fix]]

    def missing_for(self, fix: str) -> list[str]:
        """What ``fix`` needs and this torch lacks (everything when there is no FSDP2 package)."""
        if self.fsdp_package is None:
            return list(self.missing)
        return [what for what, owner in zip(self.missing, self.missing_owners) if owner in FIX_SYMBOLS[fix]]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["symbols"][name]
        except KeyError:
            raise AttributeError(name) from None


def _resolve(package: str, module_name: str, attr: str) -> Any:
    absolute = package + module_name if module_name.startswith(".") or not module_name else module_name
    return getattr(importlib.import_module(absolute), attr)


@functools.lru_cache(maxsize=None)
def load_internals() -> TorchInternals:
    """Find every private symbol; never raises (missing ones are listed instead)."""
    internals = TorchInternals()
    for package in FSDP2_PACKAGES:
        try:
            importlib.import_module(package + "._fsdp_param_group")
        except Exception:  # noqa: BLE001 - any failure means "not this layout"
            continue
        internals.fsdp_package = package
        break
    if internals.fsdp_package is None:
        internals.note_missing("FSDP2 (fully_shard) package: " + " or ".join(FSDP2_PACKAGES), "*")
        return internals
    for name, module_name, attr in PRIVATE_SYMBOLS:
        try:
            internals.symbols[name] = _resolve(internals.fsdp_package, module_name, attr)
        except Exception:  # noqa: BLE001
            internals.note_missing(f"{module_name.lstrip('.')}.{attr}", name)
    for owner, method in WRAPPED_METHODS:
        cls = internals.symbols.get(owner)
        if cls is not None and not callable(getattr(cls, method, None)):
            internals.note_missing(f"{cls.__name__}.{method}", owner)
    if "FSDPParamGroup" in internals.symbols:
        # Note [Foreign patches]: torch's own constructor is judged, never a wrapper in front of it.
        init = internals.FSDPParamGroup.__init__
        own = param_group_init_of_torch(init)
        if own is None:
            internals.note_hidden(
                f"FSDPParamGroup.__init__ is {describe_function(init)}, another library's wrapper that keeps no "
                "reference the plugin can follow to torch's own function (__wrapped__, a closure or a global), so "
                "it cannot see which arguments torch's takes; apply that wrapper after import torch_fsdp_ext, or "
                "with functools.wraps",
                "FSDPParamGroup",
            )
        else:
            params = inspect.signature(own).parameters
            for argument in ("params", "mp_policy", "modules"):
                if argument not in params:
                    internals.note_missing(f"FSDPParamGroup.__init__ argument {argument!r}", "FSDPParamGroup")
    return internals


def param_group_init_of_torch(init: Callable) -> Callable | None:
    """Torch's own ``FSDPParamGroup.__init__`` behind ``init`` (the class's, whoever wrapped it), or None."""
    return torch_own(init, "__init__")


def fsdp2_api() -> types.ModuleType:
    """The public module that exports ``fully_shard`` and its policies on this release."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):  # >= 2.6, 2.5
        module = importlib.import_module(name)
        if hasattr(module, "fully_shard"):
            return module
    raise ImportError("this torch has no FSDP2 (fully_shard)")


def symbol_names(internals: TorchInternals, names: tuple[str, ...]) -> list[str]:
    """Human-readable ``module.Class.method`` names for the status report.

    ``names`` holds owners (``"FSDPParamGroup"``: all its wrapped methods) or single
    methods (``"FSDPState._lazy_init"``).
    """
    out = []
    for owner, method in WRAPPED_METHODS:
        if (owner in names or f"{owner}.{method}" in names) and owner in internals.symbols:
            obj = internals.symbols[owner]
            prefix = obj.__name__ if isinstance(obj, types.ModuleType) else f"{obj.__module__}.{obj.__qualname__}"
            out.append(f"{prefix}.{method}")
    return out


# ---------------------------------------------------------------------------
# FSDP2 objects
# ---------------------------------------------------------------------------


def fsdp_states() -> list[Any]:
    """Every live ``FSDPState``, found through the module -> state registry of composable APIs.

    Note: ``_module_state_mapping`` maps each module to a weak reference of its
    state (2.4+; a plain reference before). Another thread may insert into it
    (``fully_shard``) while we copy it, which makes the copy raise; copy again.
    Never walk ``gc.get_objects()`` instead: that crashes a thread training
    concurrently (torch_fsdp_ext issue 13).
    """
    internals = load_internals()
    mapping = internals.module_state_mapping
    for _ in range(100):
        try:
            entries = list(mapping.values())
            break
        except RuntimeError:  # changed size during iteration
            continue
    else:
        entries = []
    states, seen = [], set()
    for entry in entries:
        state = entry() if isinstance(entry, weakref.ref) else entry
        if isinstance(state, internals.FSDPState) and id(state) not in seen:
            seen.add(id(state))  # fully_shard([a, b]) maps several modules to one state
            states.append(state)
    return states


# ``FSDPState._is_root``: None until ``_lazy_init`` ran for the state (as root or as a
# child of one), then True or False. Read at every FSDP pre-forward, hence a C-level getter.
is_root_flag: Callable[[Any], bool | None] = operator.attrgetter("_is_root")


def fsdp_state_of(module: torch.nn.Module) -> Any:
    """The ``FSDPState`` that ``fully_shard`` gave ``module``, or None."""
    internals = load_internals()
    entry = internals.module_state_mapping.get(module)
    state = entry() if isinstance(entry, weakref.ref) else entry
    return state if isinstance(state, internals.FSDPState) else None


def fsdp_states_under(root: torch.nn.Module) -> list[Any]:
    """The FSDP states in ``root``'s module tree, outermost first: what ``root``'s lazy init makes its own."""
    states, seen = [], set()
    for module in root.modules():
        state = fsdp_state_of(module)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


def state_dict_entry_points() -> list[tuple[types.ModuleType, str]]:
    """Where ``torch.distributed.checkpoint.state_dict`` reaches a model's tensors or its optimizers'
    state: (module, function name) of each module-level function that takes the model first.

    Note: ``_load_model_state_dict`` copies full (or rank-0 broadcast) tensors into the
    model's local shards in place, before it calls ``load_state_dict()``, so a module
    hook runs too late to widen a shard first; ``_get_optim_state_dict`` initialises
    missing optimizer state with a zero-lr step and ``_load_optim_state_dict`` loads
    into the optimizer (``set_state_dict`` loads the optimizer before the model).
    Found by behaviour (the public functions call them through the module global),
    not by version.
    """
    try:
        from torch.distributed.checkpoint import state_dict as module
    except ImportError:
        return []
    callers = {
        "_load_model_state_dict": ("set_model_state_dict", "set_state_dict"),
        "_get_optim_state_dict": ("get_optimizer_state_dict", "get_state_dict"),
        "_load_optim_state_dict": ("set_optimizer_state_dict", "set_state_dict"),
    }
    def called_by(name: str, caller: str) -> bool:
        code = getattr(getattr(module, caller, None), "__code__", None)
        return code is not None and name in code.co_names

    return [
        (module, name)
        for name, public in callers.items()
        if callable(getattr(module, name, None)) and all(called_by(name, caller) for caller in public)
    ]


def root_module_of(state: Any) -> torch.nn.Module | None:
    """The module a state's lazy init would make the root of its tree (None: FSDP refuses several)."""
    modules = getattr(state, "_modules", ())
    return modules[0] if len(modules) == 1 else None


def user_class_name(module: torch.nn.Module) -> str:
    """The module's own class name: ``fully_shard`` swaps in a generated ``FSDP<Name>`` subclass."""
    cls = type(module)
    for base in cls.__bases__:
        if cls.__name__ == "FSDP" + base.__name__:
            return base.__name__
    return cls.__name__


def holds_sharded_param(fsdp_param: Any) -> bool:
    """Whether the module holds the parameter's sharded form now (``FSDPParam.sharded_state`` is
    ``SHARDED``), not its unsharded one (after ``unshard()``, inside a forward) nor the smaller
    post-forward one (``reshard_after_forward`` as an int)."""
    state = getattr(fsdp_param, "sharded_state", None)
    return state is None or state.name == "SHARDED"


def current_module_param(fsdp_param: Any) -> torch.nn.Parameter:
    """The sharded parameter as the model has it now: ``load_state_dict(assign=True)`` replaces the
    object ``FSDPParam.sharded_param`` refers to until FSDP's lazy init picks up the new one.

    Note: while the module holds the unsharded parameter (Note [Unsharded now]), the sharded one is
    FSDP's own: a load reshards first (FSDP's state-dict pre-hooks), so nothing replaced it.
    """
    if not holds_sharded_param(fsdp_param):
        return fsdp_param.sharded_param
    info = fsdp_param._module_info
    return getattr(info.module, info.param_name)


def sync_sharded_param(fsdp_param: Any) -> None:
    """What FSDP's lazy init does first (``reset_sharded_param``), for a replaced parameter only."""
    if current_module_param(fsdp_param) is not fsdp_param.sharded_param:
        fsdp_param.reset_sharded_param()


def reset_sharded_param(fsdp_param: Any) -> None:
    """``FSDPParam.reset_sharded_param`` after the sharded parameter's data changed in place (``swap_tensors``).

    Note [Unsharded now]: torch's method reads the parameter from the module, which holds the
    unsharded one between ``unshard()`` and ``reshard()``; the sharded one is shown to it for the
    call and the unsharded one put back, so the module's unsharded view stays as it was.
    """
    if holds_sharded_param(fsdp_param):
        fsdp_param.reset_sharded_param()
        return
    info = fsdp_param._module_info
    held = getattr(info.module, info.param_name)
    fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
    try:
        fsdp_param.reset_sharded_param()
    finally:
        fsdp_param._setattr_on_modules(held)



def reshard_group(group: Any) -> None:
    """Put a param group's sharded parameters back on its modules (``FSDPParamGroup.reshard``): a
    sharded parameter can change (``reset_sharded_param``) only while the module holds it."""
    group.reshard()


def redo_group_mp_dtypes(group: Any) -> None:
    """FSDP's per-parameter and group dtypes, redone as an explicit ``unshard()`` redoes them."""
    group._init_mp_dtypes()


def local_tensor_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a slot, not in ``__dict__``), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def half_initialised_roots() -> list[tuple[list[Any], list[str]]]:
    """The modules of root states whose first lazy init raised part-way, with the groups it left unfinished.

    Note: ``FSDPState._lazy_init`` marks the state as root before it sets up the
    param groups (``FSDPParamGroup.lazy_init``) and never runs again, so after an
    error there (FSDP's uniform-dtype assertion) the groups stay without their
    mixed-precision attributes and the next forward or backward fails with an
    ``AttributeError``. A group past the assertion has ``_reduce_dtype``, which
    ``_init_mp_dtypes`` sets right after it on every release; a later step of its
    lazy init that fails (2.15 runs two more) is not seen here.
    """
    roots = []
    for state in fsdp_states():
        if is_root_flag(state) is not True:
            continue
        all_states = getattr(getattr(state, "_state_ctx", None), "all_states", [])
        unfinished = [
            group_name(group)
            for member in all_states
            for group in param_groups_of(member)
            if "_reduce_dtype" not in group.__dict__
        ]
        if unfinished:
            roots.append((list(state._modules), unfinished))
    return roots


def process_group_store(pg: Any) -> Any:
    """A c10d ``Store`` whose keys are this process group's own, or None.

    The group's own store (``new_group`` makes a prefix store per group); groups
    made without one (``split_group``) get a prefix of the default store named
    after the group.
    """
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._world.pg_map[pg][1]
        if store is None:
            store = c10d.PrefixStore(f"torch_fsdp_ext/{c10d._get_process_group_name(pg)}/", c10d._get_default_store())
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError):
        return None
    return store


def process_group_timeout(pg: Any) -> Any:
    """The timeout the process group's own collectives wait (``init_process_group(timeout=...)``), or None.

    Note: read from each backend's options (``ProcessGroupGloo/NCCL.options._timeout``,
    the longest where a group has several backends); the group's store may have a
    shorter one of its own (``TCPStore(timeout=...)``).
    """
    try:
        timeouts = [pg._get_backend(device).options._timeout for device in pg._device_types]
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return max(timeouts, default=None)


def param_groups_of(state: Any) -> list[Any]:
    """``FSDPState``'s param groups: a list on >= 2.11, a single optional group before.

    Note: never ``state.__dict__``. CPython keeps the attributes of an object with
    few of them in an inline array until something reads its ``__dict__``; from then
    on every attribute access on it is a dict lookup. FSDP states are such objects
    and FSDP reads their attributes many times per step: reading the ``__dict__`` of
    each state once cost ~80k instructions per step on 8 blocks, for the rest of the
    run (``tools/bench_instructions.py``).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def bind_param_group_init(init: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind ``FSDPParamGroup.__init__`` arguments by name (their positions moved over releases), by the
    signature of torch's own function behind ``init`` (a foreign wrapper's may be ``(self, *a, **k)``)."""
    return _param_group_init_signature(init).bind(*args, **kwargs)


@functools.lru_cache(maxsize=4)
def _param_group_init_signature(init: Callable) -> inspect.Signature:
    return inspect.signature(param_group_init_of_torch(init) or init)


def group_name(group: Any) -> str:
    """The FQN of the module a param group belongs to; ``'<root>'`` for the root module."""
    return getattr(group, "_module_fqn", None) or "<root>"


def group_modules(group: Any) -> tuple:
    """The modules a param group was built for (the ``fully_shard`` call's modules)."""
    return tuple(getattr(group, "modules", ()))


def group_process_group(group: Any) -> Any:
    """The process group the param group all-gathers over (its shard group)."""
    return group._all_gather_process_group


def param_mp_policy(group: Any, fsdp_param: Any) -> Any:
    """The ``MixedPrecisionPolicy`` of one parameter: per ``FSDPParam`` from 2.15, per group before."""
    policy = getattr(fsdp_param, "mp_policy", None)
    return policy if policy is not None else group.mp_policy


def fsdp_param_fqn(fsdp_param: Any) -> str | None:
    return getattr(fsdp_param, "_param_fqn", None)


def fsdp_param_name(fsdp_param: Any, index: int) -> str:
    """The parameter's FQN (known from the first lazy init), else its module class and attribute name."""
    fqn = fsdp_param_fqn(fsdp_param)
    if fqn:
        return fqn
    info = getattr(fsdp_param, "_module_info", None)
    if info is None:
        return f"<param {index}>"
    return f"{type(info.module).__name__}:{info.param_name}"


def fsdp_param_is_trainable(fsdp_param: Any) -> bool:
    return bool(fsdp_param.sharded_param.requires_grad)


def dynamo_decorator(method: Callable) -> tuple[Callable, Callable] | None:
    """The decorator that marks ``method`` for dynamo, and the function it decorates; None if undecorated.

    Probed, not looked up by name or version: the decorator is the function of
    ``method``'s module (its globals) whose code builds ``method``'s code, and the
    decorated function is what ``functools.wraps`` recorded as ``__wrapped__``.
    """
    code = getattr(method, "__code__", None)
    undecorated = getattr(method, "__wrapped__", None)
    if code is None or not callable(undecorated):
        return None
    for candidate in method.__globals__.values():
        if isinstance(candidate, types.FunctionType) and code in candidate.__code__.co_consts:
            return candidate, undecorated
    return None


def decorated_method_cell(method: Callable) -> types.CellType | None:
    """The closure cell through which torch's dynamo decorator of ``method`` calls the method it
    decorates (``__wrapped__``); None where ``method`` calls it some other way or is undecorated."""
    undecorated = getattr(method, "__wrapped__", None)
    for cell in getattr(method, "__closure__", None) or ():
        try:
            if undecorated is not None and cell.cell_contents is undecorated:
                return cell
        except ValueError:  # an empty cell
            continue
    return None


def dynamo_decorator_reads_skip_fsdp_hooks(decorator: Callable) -> bool:
    """Does the decorated hook leave dynamo's skip to ``torch._dynamo.config.skip_fsdp_hooks`` (<= 2.11)?"""
    return any(
        isinstance(const, types.CodeType) and "skip_fsdp_hooks" in const.co_names
        for const in decorator.__code__.co_consts
    )


def skip_fsdp_hooks() -> bool:
    """``torch._dynamo.config.skip_fsdp_hooks``; True where the switch does not exist (2.13+)."""
    import torch._dynamo

    return bool(getattr(torch._dynamo.config, "skip_fsdp_hooks", True))


def local_shard_numel(fsdp_param: Any) -> int:
    return fsdp_param.sharded_param._local_tensor.numel()


# ---------------------------------------------------------------------------
# The reduce path of groups that keep mixed dtypes (``_mixed_groups``)
# ---------------------------------------------------------------------------

# Owners whose methods the dtype fix wraps where the reduce-scatter casts its whole output to one dtype.
MIXED_REDUCE_OWNERS = ("FSDPParamGroup", "FSDPParam", "fsdp_param_group_module")

@functools.lru_cache(maxsize=None)
def probe_reduce_casts_grads_per_param() -> bool | None:
    """Does this release give each parameter its gradient in its own dtype after the reduce-scatter?

    Note: up to 2.14 ``foreach_reduce`` takes the group's ``orig_dtype`` and casts
    the whole reduce output to it; 2.15 dropped that argument and casts per
    parameter (``sharded_grad_dtype``). Read on torch's own function, never on what
    another library put in its place (Note [Foreign patches]); None where torch's own
    cannot be found.
    """
    foreach_reduce = torch_own(load_internals().fsdp_param_group_module.foreach_reduce, "foreach_reduce")
    if foreach_reduce is None:
        return None
    return "orig_dtype" not in inspect.signature(foreach_reduce).parameters


# Note [Foreign patches]. Other libraries patch FSDP2's internals too (NeMo Automodel's
# ``patch_fsdp_uniform_reduce_dtype`` replaces ``foreach_reduce`` in ``_fsdp_collectives`` and
# ``_fsdp_param_group`` with a wrapper that widens a group's gradients, then calls torch's).
# A signature read on such a wrapper says nothing about torch, and a wrapper applied after the
# plugin's may drop it. So who owns a function is told by where its code lives (identity:
# ``__code__.co_filename`` under torch's package, under this plugin's, or elsewhere), never by
# its names or signature, which ``functools.wraps`` copies; torch's own function is found
# through what a wrapper keeps of it (``__wrapped__``, its closure, the global it calls).
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def function_origin(fn: Any) -> str:
    """``"torch"``, ``"torch_fsdp_ext"`` or ``"foreign"``: whose file the function's code comes from."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    filename = os.path.abspath(code.co_filename) if code is not None else ""
    if filename.startswith(_PLUGIN_DIR):
        return "torch_fsdp_ext"
    if filename.startswith(_TORCH_DIR):
        return "torch"
    return "foreign"


def _code_name(fn: Any) -> str | None:
    code = getattr(inspect.unwrap(fn, stop=lambda f: function_origin(f) != "torch"), "__code__", None)
    return code.co_name if code is not None else None


def torch_own(fn: Any, name: str) -> Any:
    """Torch's own function ``name`` behind ``fn`` (``fn`` itself when torch's), or None.

    Searched through the wrappers in front of it: ``__wrapped__``, closure cells, and the
    global of the same name a wrapper's code calls. Torch's own decorators (``torch.no_grad()``)
    count as torch's.
    """
    seen, queue = set(), [fn]
    while queue and len(seen) < 64:
        candidate = queue.pop(0)
        if id(candidate) in seen or not callable(candidate):
            continue
        seen.add(id(candidate))
        if function_origin(candidate) == "torch" and _code_name(candidate) == name:
            return candidate
        queue.append(getattr(candidate, "__wrapped__", None))
        for cell in getattr(candidate, "__closure__", None) or ():
            try:
                queue.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        code = getattr(candidate, "__code__", None)
        for global_name in code.co_names if code is not None else ():
            queue.append(getattr(candidate, "__globals__", {}).get(global_name))
    return None


def foreign_functions_before_torch(fn: Any, name: str) -> list[str]:
    """``module.qualname`` of each foreign function met on the way from ``fn`` to torch's own ``name``."""
    found, seen, queue = [], set(), [fn]
    while queue and len(seen) < 64:
        candidate = queue.pop(0)
        if id(candidate) in seen or not callable(candidate):
            continue
        seen.add(id(candidate))
        origin = function_origin(candidate)
        if origin == "torch":
            continue
        if origin == "foreign" and getattr(candidate, "__code__", None) is not None:
            found.append(describe_function(candidate))
        queue.append(getattr(candidate, "__wrapped__", None))
        for cell in getattr(candidate, "__closure__", None) or ():
            try:
                queue.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    return found


# The functions whose foreign wrappers the plugin composes with exactly (``_mixed_groups``; the group
# constructor: Note [Built past the hook] in ``_dtype._fix``).
COMPOSED_FOREIGN = frozenset({("fsdp_param_group_module", "foreach_reduce"), ("FSDPParamGroup", "__init__")})


def foreign_patches(fix: str) -> list[str]:
    """``owner.method is module.qualname`` for each function ``fix`` wraps that another library replaced,
    except those it composes with exactly (``COMPOSED_FOREIGN``)."""
    internals = load_internals()
    found = []
    for owner, method in WRAPPED_METHODS:
        if owner not in FIX_SYMBOLS[fix]:
            continue
        obj = internals.symbols.get(owner)
        fn = getattr(obj, method, None) if obj is not None else None
        if fn is not None and (owner, method) not in COMPOSED_FOREIGN and function_origin(fn) == "foreign":
            found.append(f"{symbol_names(internals, (f'{owner}.{method}',))[0]} is {describe_function(fn)}")
    return found


def describe_function(fn: Any) -> str:
    """``module.qualname`` of the code that runs: a wrapper's own, not what ``functools.wraps`` copied onto it."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return repr(fn)
    qualname = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python >= 3.11
    filename = os.path.abspath(code.co_filename)
    for module_name, module in list(sys.modules.items()):
        module_file = getattr(module, "__file__", None)
        if module_file and os.path.abspath(module_file) == filename:
            return f"{module_name}.{qualname}"
    return f"{filename}:{qualname}"


# ---------------------------------------------------------------------------
# Forward hooks registered by FSDPState.init
# ---------------------------------------------------------------------------


def forward_hook_slots(state: Any) -> list[tuple[dict, int, str]] | None:
    """Where ``FSDPState.init`` stored its pre/post-forward hooks as bound methods.

    Returns ``[(hooks_dict, hook_id, "pre"|"post"), ...]``, or ``None`` when the
    hooks are closures (grouped ``fully_shard([a, b])``), which cannot be re-bound.
    """
    slots = []
    for kind, attr in (("pre", "_pre_forward_hook_handle"), ("post", "_post_forward_hook_handle")):
        handle = getattr(state, attr, None)  # not state.__dict__: see param_groups_of
        if handle is None:
            return []
        dict_ref = getattr(handle, "hooks_dict_ref", None)
        hooks = dict_ref() if dict_ref is not None else None
        if hooks is None or handle.id not in hooks:
            return None
        hook = hooks[handle.id]
        if not isinstance(hook, types.MethodType) or hook.__self__ is not state:
            return None
        slots.append((hooks, handle.id, kind))
    return slots


# ---------------------------------------------------------------------------
# Forward-context helpers used by the recompute replay
# ---------------------------------------------------------------------------


def moves_inputs_to(device: torch.device) -> bool:
    return device.type in _INPUT_MOVING_DEVICE_TYPES or (
        device.type == torch._C._get_privateuse1_backend_name()
    )


def move_inputs(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """The root's input move, exactly as ``FSDPState._root_pre_forward`` does it."""
    internals = load_internals()
    args_tuple, kwargs_tuple = internals.to_kwargs(args, kwargs, device, False)
    return args_tuple[0], kwargs_tuple[0]


# Note: the device RNG seam. The recompute replay reads and sets an accelerator's RNG
# state only through ``device_rng_state`` / ``set_device_rng_state``, which ask
# ``device_rng_module`` for the device's module (``torch.cuda`` for a CUDA device).
# Tests without an accelerator point ``device_rng_module`` at a stand-in module with
# its own generator (test/test_recompute_rng.py).
def device_rng_module(device: torch.device) -> Any:
    """The module whose ``get_rng_state(device)`` / ``set_rng_state(state, device)`` serve ``device``."""
    return torch.get_device_module(device)


def device_rng_state(device: torch.device) -> torch.Tensor | None:
    """``device``'s RNG state; None where its module has no RNG functions (a backend without them)."""
    get_rng_state = getattr(device_rng_module(device), "get_rng_state", None)
    return get_rng_state(device) if get_rng_state is not None else None


def set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    device_rng_module(device).set_rng_state(state, device)


def checkpoint_preserves_rng_state(recompute_fn: Callable) -> bool:
    """The ``preserve_rng_state`` of the non-reentrant checkpoint whose frame holds ``recompute_fn``.

    Note: checkpoint keeps the flag only in the closure of the recompute function
    it gives its ``_CheckpointFrame`` (2.5 to 2.15). Where the closure has no such
    name this answers True: restoring the forward's RNG state keeps the
    recomputation equal to the forward, the conservative choice.
    """
    code = getattr(recompute_fn, "__code__", None)
    try:
        cell = recompute_fn.__closure__[code.co_freevars.index("preserve_rng_state")]
        return bool(cell.cell_contents)
    except (AttributeError, IndexError, TypeError, ValueError):
        return True


def has_tensors_off(device: torch.device, value: Any) -> bool:
    """Would the root's input move change ``value`` (a tensor in it is not on ``device``)?"""
    off = []
    load_internals().apply_to_tensors(lambda tensor: off.append(tensor.device != device) or tensor, value)
    return any(off)


def cast_floating_tensors(dtype: torch.dtype, value: Any) -> Any:
    """FSDP2's own mixed-precision cast (floating tensors only, nested containers)."""
    internals = load_internals()
    return internals.apply_to_tensors(functools.partial(internals.cast_fp_tensor, dtype), value)


def floating_dtype_finder() -> Callable[[Any], torch.dtype | None]:
    """A function giving the dtype of the first floating tensor in a value (nested containers), or None.

    Bound once, like ``floating_tensor_cast``, for hooks that torch.compile traces.
    """
    apply = load_internals().apply_to_tensors

    def first_floating_dtype(value: Any) -> torch.dtype | None:
        found: list[torch.dtype] = []

        def note(tensor: torch.Tensor) -> torch.Tensor:
            if not found and tensor.is_floating_point():
                found.append(tensor.dtype)
            return tensor

        apply(note, value)
        return found[0] if found else None

    return first_floating_dtype


def floating_tensor_cast_to() -> Callable[[torch.dtype, Any], Any]:
    """``cast_floating_tensors`` with the internals bound once, for hooks that torch.compile traces."""
    internals = load_internals()
    apply, cast = internals.apply_to_tensors, internals.cast_fp_tensor
    return lambda dtype, value: apply(functools.partial(cast, dtype), value)


def floating_tensor_cast(dtype: torch.dtype) -> Callable[[Any], Any]:
    """``cast_floating_tensors`` bound to ``dtype`` once, for hooks that torch.compile traces."""
    internals = load_internals()
    apply, cast = internals.apply_to_tensors, functools.partial(internals.cast_fp_tensor, dtype)
    return lambda value: apply(cast, value)


def accelerator_device_type() -> str | None:
    """This machine's accelerator ("cuda", "xpu", ...), or None.

    Note: ``torch.accelerator`` is new in 2.6, where ``current_accelerator()``
    raises instead of returning None on a machine without one.
    """
    accelerator = getattr(torch, "accelerator", None)
    try:
        current = accelerator.current_accelerator() if accelerator is not None else None
    except RuntimeError:
        current = None
    if current is not None:
        return current.type
    return "cuda" if torch.cuda.is_available() else None


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``input`` gathered along dim 0 into ``output`` (a public collective, under two names).

    Note: ``torch.distributed.all_gather_single`` is the name from 2.13 on, where ``all_gather_into_tensor``
    became its alias, deprecated with a FutureWarning on every call in 2.13 and 2.14; releases before 2.13
    have only ``all_gather_into_tensor``. The name is looked up, not the version compared.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def current_graph_task_id() -> int:
    return torch._C._current_graph_task_id()


def _any_autocast_enabled_by_device() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", accelerator_device_type() or "cpu"))


# One call that answers "is autocast on for any device type": the hot path of
# every checkpointed FSDP forward asks it instead of reading each device's state.
any_autocast_enabled: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast_enabled_by_device)


# ---------------------------------------------------------------------------
# Feature probes
# ---------------------------------------------------------------------------


class _ProbeParam:
    """Duck-typed ``FSDPParam`` with just what ``_init_mp_dtypes`` and a group's lazy init read."""

    def __init__(self, dtype: torch.dtype, requires_grad: bool) -> None:
        self.sharded_param = types.SimpleNamespace(dtype=dtype, requires_grad=requires_grad, device=torch.device("cpu"))
        self.mp_policy = None
        self.unsharded_grad_dtype = self.sharded_grad_dtype = None  # 2.15: no grad_dtype set
        self._param_fqn = f"probe.{dtype}"

    def init_dtype_attrs(self, mp_policy: Any) -> None:
        self.orig_dtype = self.sharded_param.dtype
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None)


def _rejects(run: Callable[[], Any]) -> bool | None:
    """True if ``run`` fails torch's uniform-dtype assertion, False if it completes, None otherwise."""
    try:
        run()
    except AssertionError as e:
        return "uniform original parameter dtype" in str(e) or None
    except Exception:  # noqa: BLE001 - internals we do not understand
        return None
    return False


def _probe_group(internals: TorchInternals, params: list[_ProbeParam]) -> Any:
    return types.SimpleNamespace(
        fsdp_params=params, mp_policy=internals.MixedPrecisionPolicy(), _orig_dtype=None, _reduce_dtype=None
    )


def _lazy_init_probe_group(internals: TorchInternals, params: list[_ProbeParam]) -> Any:
    """A real ``FSDPParamGroup`` of no parameters, from its own ``__init__``, then given ``params``:
    its lazy init finds them already reset and its state-dict hooks in place."""
    init = param_group_init_of_torch(internals.FSDPParamGroup.__init__)
    if init is None:
        return None
    known = {
        "params": [], "modules": (), "device": torch.device("cpu"), "mp_policy": internals.MixedPrecisionPolicy(),
    }
    names = [name for name in inspect.signature(init).parameters if name != "self"]
    group = object.__new__(internals.FSDPParamGroup)
    init(group, **{name: known.get(name) for name in names})
    hooked = {torch.nn.Identity(): None}
    group.__dict__.update(
        fsdp_params=params, _reset_sharded_params=True, _module_to_pre_save_state_dict_hook_handle=hooked,
        _module_to_pre_load_state_dict_hook_handle=dict(hooked),
    )
    return group


def _run_dtype_check(params: list[_ProbeParam]) -> bool | None:
    """True if ``_init_mp_dtypes`` rejects this layout, False if it accepts it."""
    internals = load_internals()
    return _rejects(lambda: internals.FSDPParamGroup._init_mp_dtypes(_probe_group(internals, params)))


@functools.lru_cache(maxsize=None)
def probe_uniform_dtype_check() -> str | None:
    """Where this release rejects bf16 + fp32 trainable params of one group: ``"_init_mp_dtypes"``,
    ``"lazy_init"`` (elsewhere in ``FSDPParamGroup.lazy_init``) or ``"nowhere"``; None when it cannot tell."""
    # Note: ``_init_mp_dtypes`` alone is not enough: a release that moved the check into the group's
    # lazy init would pass it, and the plugin would say "fixed upstream" while torch still refuses.
    internals = load_internals()
    layout = [_ProbeParam(torch.bfloat16, True), _ProbeParam(torch.float32, True)]
    in_init = _run_dtype_check(layout)
    if in_init:
        return "_init_mp_dtypes"
    try:
        group = _lazy_init_probe_group(internals, layout)
    except Exception:  # noqa: BLE001 - an __init__ we do not understand
        group = None
    in_lazy_init = None if group is None else _rejects(lambda: internals.FSDPParamGroup.lazy_init(group))
    if in_lazy_init:
        return "lazy_init"
    if in_init is False and in_lazy_init is False:
        return "nowhere"
    return None


@functools.lru_cache(maxsize=None)
def probe_rejects_mixed_trainable_dtypes() -> bool | None:
    """Does this release reject bf16 + fp32 trainable params in one group (pytorch#156784)?"""
    return {"_init_mp_dtypes": True, "lazy_init": True, "nowhere": False}.get(probe_uniform_dtype_check())


@functools.lru_cache(maxsize=None)
def probe_dtype_check_counts_frozen() -> bool | None:
    """Does the check also count frozen params (torch 2.5 did; pytorch#154103)?"""
    return _run_dtype_check([_ProbeParam(torch.bfloat16, False), _ProbeParam(torch.float32, True)])


def _recompute_probe_state(mp_policy: Any) -> Any:
    internals = load_internals()
    state = internals.FSDPState()
    state._training_state = internals.TrainingState.PRE_BACKWARD
    state._mp_policy = mp_policy
    if "_fsdp_param_groups" in state.__dict__:
        state._fsdp_param_groups = []
    else:
        state._fsdp_param_group = None
    return state


@functools.lru_cache(maxsize=None)
def probe_recompute_casts_inputs() -> bool | None:
    """Does ``_pre_forward`` cast inputs when running during recomputation (pytorch#182580)?"""
    internals = load_internals()
    try:
        state = _recompute_probe_state(internals.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        args, _ = internals.FSDPState._pre_forward(state, torch.nn.Identity(), (torch.zeros(1),), {})
    except Exception:  # noqa: BLE001
        return None
    return args[0].dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def probe_recompute_casts_outputs() -> bool | None:
    """Does ``_post_forward`` apply ``output_dtype`` during recomputation?"""
    internals = load_internals()
    try:
        policy = internals.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float16)
        state = _recompute_probe_state(policy)
        out = internals.FSDPState._post_forward(state, torch.nn.Identity(), (), torch.zeros(1))
    except Exception:  # noqa: BLE001
        return None
    return out.dtype == torch.float16


@functools.lru_cache(maxsize=None)
def probe_recompute_moves_inputs() -> bool | None:
    """Does ``_pre_forward`` re-run the root's input move during recomputation?"""
    internals = load_internals()
    calls = []
    try:
        state = _recompute_probe_state(internals.MixedPrecisionPolicy())
        state._root_pre_forward = lambda module, args, kwargs: calls.append(1) or (args, kwargs)
        internals.FSDPState._pre_forward(state, torch.nn.Identity(), (torch.zeros(1),), {})
    except Exception:  # noqa: BLE001
        return None
    return bool(calls)


# ---------------------------------------------------------------------------
# Behaviour probes of what the recompute replay wraps and reads
# ---------------------------------------------------------------------------

# Note: why run a checkpoint. Every name the recompute replay wraps can still
# resolve on a release where its meaning changed (the frame's recompute
# function under another attribute, the recomputation hook given the frame and
# not a weak reference to it), and its wrappers run for *every* non-reentrant
# checkpoint in the process, FSDP or not. So before installing, one tiny
# checkpoint without FSDP runs forward and backward with observers in place of
# the hooks' ``__init__`` and ``__enter__``; the replay installs only where it
# saw what its wrappers read. Observers, not the wrappers themselves: this
# layer knows torch, not the fix.


def _observe_checkpoint_hooks(internals: TorchInternals) -> list[tuple[str, Any]]:
    """Run one non-reentrant checkpoint and its recomputation; return what the hooks were given, in order."""
    seen: list[tuple[str, Any]] = []
    originals = []

    def observe(cls: type, method: str, event: str) -> None:
        original = cls.__dict__.get(method)
        inherited = getattr(cls, method)

        def observer(hook: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append((event, args[0] if args else None))
            return inherited(hook, *args, **kwargs)

        originals.append((cls, method, original))
        setattr(cls, method, observer)

    # Note: checkpoint resolves its default device type on first use and caches it on the
    # class (None until then). The probe must not resolve it for the user: an accelerator that
    # becomes visible later would otherwise have its RNG state stashed for the wrong device type.
    device_type_cache = vars(torch.utils.checkpoint.DefaultDeviceType).get("_default_device_type")
    try:
        observe(internals.checkpoint_hook, "__init__", "checkpoint")
        observe(internals.checkpoint_hook, "__enter__", "forward")
        observe(internals.recomputation_hook, "__init__", "recompute")
        observe(internals.recomputation_hook, "__enter__", "recomputing")
        x = torch.ones(2, requires_grad=True)
        torch.utils.checkpoint.checkpoint(lambda t: (t * t).sin(), x, use_reentrant=False).sum().backward()
    finally:
        for cls, method, original in reversed(originals):
            if original is None:
                delattr(cls, method)
            else:
                setattr(cls, method, original)
        if "_default_device_type" in vars(torch.utils.checkpoint.DefaultDeviceType):
            torch.utils.checkpoint.DefaultDeviceType._default_device_type = device_type_cache
    return seen


@functools.lru_cache(maxsize=None)
def probe_checkpoint_frames() -> str | None:
    """None where a non-reentrant checkpoint gives its hooks what the recompute replay reads; else what differs.

    Read: ``_checkpoint_hook(frame)`` with ``frame.recompute_fn`` callable and
    attributes settable on frame and hook; ``_recomputation_hook(ref)`` where
    ``ref()`` is that frame; forward enters the checkpoint hook and backward the
    recomputation hook, one each here.
    """
    internals = load_internals()
    try:
        seen = _observe_checkpoint_hooks(internals)
    except Exception as e:  # noqa: BLE001
        return f"a plain checkpoint failed under observation: {e!r}"
    events = [event for event, _ in seen]
    if events != ["checkpoint", "forward", "recompute", "recomputing"]:
        return f"checkpoint calls its hooks as {events}, not checkpoint, forward, recompute, recomputing"
    frame, frame_ref = seen[0][1], seen[2][1]
    if not callable(getattr(frame, "recompute_fn", None)):
        return f"{type(frame).__name__} has no callable recompute_fn"
    if not isinstance(frame_ref, weakref.ReferenceType) or frame_ref() is not frame:
        return f"_recomputation_hook is given {type(frame_ref).__name__}, not a weak reference to the frame"
    try:
        setattr(frame, "_torch_fsdp_ext_probe", None)
        delattr(frame, "_torch_fsdp_ext_probe")
    except Exception as e:  # noqa: BLE001
        return f"{type(frame).__name__} takes no attributes: {e!r}"
    return None


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


@functools.lru_cache(maxsize=None)
def probe_fsdp_forward_state() -> str | None:
    """None where FSDP's forward state has what the recompute replay's pre/post-forward wrappers read; else what not.

    Read on a fresh ``FSDPState``: ``_training_state`` (a ``TrainingState``, with
    ``PRE_BACKWARD``), ``_state_ctx.iter_forward_root`` (None, and claimed by
    ``_root_pre_forward``); on a ``MixedPrecisionPolicy``: ``param_dtype``,
    ``output_dtype``, ``cast_forward_inputs``. ``_device`` and ``_mp_policy``
    are set by ``FSDPState.init``, which the probes of the casts exercise.
    """
    internals = load_internals()
    try:
        state = internals.FSDPState()
        policy = internals.MixedPrecisionPolicy()
        training_state = state._training_state
        pre_backward = internals.TrainingState.PRE_BACKWARD
        context = state._state_ctx
    except Exception as e:  # noqa: BLE001
        return f"FSDP's forward state differs: {e!r}"
    if not isinstance(training_state, internals.TrainingState) or not isinstance(pre_backward, internals.TrainingState):
        return "FSDPState._training_state is not a TrainingState"
    if "iter_forward_root" not in getattr(context, "__dict__", {}) or context.iter_forward_root is not None:
        return f"{type(context).__name__} has no iter_forward_root"
    root_pre_forward = getattr(internals.FSDPState, "_root_pre_forward", None)
    if getattr(root_pre_forward, "__code__", None) is None or "iter_forward_root" not in _code_names(
        root_pre_forward.__code__
    ):
        return "FSDPState._root_pre_forward does not claim iter_forward_root"
    missing = [a for a in ("param_dtype", "output_dtype", "cast_forward_inputs") if not hasattr(policy, a)]
    if missing:
        return f"MixedPrecisionPolicy has no {', '.join(missing)}"
    return None


def switchable_method_cell(method: Callable) -> types.CellType | None:
    """``decorated_method_cell(method)`` where a call of ``method`` is seen to run what the cell holds; else None.

    Note: the hook switch sets the cell to its wrapper; a decorator that keeps the
    cell but no longer calls through it would leave the wrapper unused, so one
    call with a stand-in in the cell checks it (and the cell is put back).
    """
    cell = decorated_method_cell(method)
    if cell is None:
        return None
    original, calls = cell.cell_contents, []
    cell.cell_contents = lambda *args, **kwargs: calls.append(args)
    try:
        method(None, None, (), {})
    except Exception:  # noqa: BLE001 - a decorator that cannot be called so is not switchable
        calls.clear()
    finally:
        cell.cell_contents = original
    return cell if calls else None


# ===========================================================================
# The reduce fix (``_reduce``): what its parts wrap and the probes that decide them
# ===========================================================================

# Note: every part of the reduce fix wraps ``foreach_reduce`` as ``FSDPParamGroup.post_backward``
# calls it (a global of ``_fsdp_param_group``), positionally: ``(fsdp_params, unsharded_grads,
# reduce_scatter_group, reduce_scatter_stream, reduce_scatter_comm, [orig_dtype,] reduce_dtype, ...)``.
# The wrappers read the dtype arguments at the positions torch's own signature gives them.


class _ProbeStop(Exception):
    """Raised by the probe's stand-in communicator once the reduce-scatter input is filled."""


class _ProbeReduceScatter:
    """Stand-in ``reduce_scatter_comm``: hands out the reduce-scatter input, then stops the call."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.input is not None:  # the reduce output: the copy-in is done
            raise _ProbeStop
        self.input = torch.full(size, float("nan"), dtype=dtype, device=device)
        return self.input


def torch_foreach_reduce() -> Any:
    """Torch's own ``foreach_reduce`` behind whatever FSDP's param group calls (Note [Foreign patches])."""
    return torch_own(load_internals().fsdp_param_group_module.foreach_reduce, "foreach_reduce")


def foreach_reduce_argument_positions() -> dict[str, int] | None:
    """Position of ``unsharded_grads``, ``orig_dtype`` (absent from 2.15) and ``reduce_dtype`` in torch's
    ``foreach_reduce``; None where torch's own cannot be found or has no ``unsharded_grads``/``reduce_dtype``."""
    foreach_reduce = torch_foreach_reduce()
    if foreach_reduce is None:
        return None
    names = list(inspect.signature(foreach_reduce).parameters)
    if "unsharded_grads" not in names or "reduce_dtype" not in names:
        return None
    return {name: names.index(name) for name in ("unsharded_grads", "orig_dtype", "reduce_dtype") if name in names}


def _copy_in_of(grads: list[torch.Tensor]) -> torch.Tensor | None | bool:
    """Run torch's ``foreach_reduce`` on one CPU rank (no process group) with ``grads`` and
    ``reduce_dtype=float32`` up to its copy-in: the reduce-scatter input it filled, False when it
    raised before filling one, None when it could not be run."""
    foreach_reduce = torch_foreach_reduce()
    if foreach_reduce is None:
        return None
    comm = _ProbeReduceScatter()
    stream = torch.cpu.current_stream()
    known = {
        "fsdp_params": [types.SimpleNamespace(fsdp_placement=types.SimpleNamespace(dim=0)) for _ in grads],
        "unsharded_grads": list(grads), "reduce_scatter_group": None, "reduce_scatter_stream": stream,
        "reduce_scatter_comm": comm, "orig_dtype": torch.float32, "reduce_dtype": torch.float32,
        "device": torch.device("cpu"), "gradient_divide_factor": None, "all_reduce_group": None,
        "all_reduce_stream": stream, "all_reduce_grads": True, "partial_reduce_output": None, "all_reduce_hook": None,
    }
    parameters = inspect.signature(foreach_reduce).parameters
    required = [n for n, p in parameters.items() if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]
    if any(name not in known for name in required):
        return None
    # Note: torch's assertion prints the rank to stdout first (``_raise_assert_with_print``).
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        try:
            foreach_reduce(**{name: value for name, value in known.items() if name in parameters})
        except _ProbeStop:
            return comm.input
        except Exception:  # noqa: BLE001 - torch refused (its assertion) or the stand-ins do not fit
            return False if comm.input is None else None
    return None


@functools.lru_cache(maxsize=None)
def probe_reduce_rejects_mixed_grad_dtypes() -> bool | None:
    """Does torch's ``foreach_reduce`` refuse a group whose gradients come in bf16 and fp32 (pytorch#196996)?

    Note: the stand-in call fills the fp32 reduce-scatter input of one CPU rank and stops.
    Uniform fp32 gradients must reach that copy-in (else None: the stand-ins do not fit this
    torch); bf16 + fp32 gradients that do not reach it mean the failure (True); reaching it
    with both values exactly in place means this torch brings them to the reduce dtype (False).
    """
    values = torch.tensor([1.0, 2.0**-10, 1.0 + 2.0**-20])
    uniform = _copy_in_of([values[:2].clone(), values[2:].clone()])
    if not isinstance(uniform, torch.Tensor) or not torch.equal(uniform, values):
        return None
    mixed = _copy_in_of([values[:2].to(torch.bfloat16), values[2:].clone()])
    if mixed is False:
        return True
    if isinstance(mixed, torch.Tensor) and torch.equal(mixed, values):
        return False
    return None


@functools.lru_cache(maxsize=None)
def probe_frozen_first_forward_drops_reduce_dtype() -> bool | None:
    """Does a group whose parameters were all frozen at its lazy init lose the reduce dtype (pytorch#186998)?

    Note: torch's own ``_init_mp_dtypes`` runs on a stand-in group of two frozen fp32
    parameters with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the
    group's ``_reduce_dtype`` is None where the failure is (up to 2.13), fp32 where it was
    fixed (pytorch#187376, 2.14).
    """
    internals = load_internals()
    group_cls = internals.symbols.get("FSDPParamGroup")
    init_mp_dtypes = torch_own(vars(group_cls).get("_init_mp_dtypes") if group_cls else None, "_init_mp_dtypes")
    if init_mp_dtypes is None:
        return None
    policy = internals.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    params = [_ProbeParam(torch.float32, False) for _ in range(2)]
    for param in params:
        param.mp_policy = policy  # 2.15 reads each parameter's policy
    group = types.SimpleNamespace(fsdp_params=params, mp_policy=policy, _orig_dtype=None, _reduce_dtype=None)
    try:
        init_mp_dtypes(group)
    except Exception:  # noqa: BLE001 - internals we do not understand
        return None
    if group._reduce_dtype is None:
        return True
    return False if group._reduce_dtype == torch.float32 else None


# ---------------------------------------------------------------------------
# reduce fix: TP all-reduce (``_reduce/_tp``)
# ---------------------------------------------------------------------------

# Note: with a DTensor parameter (tensor parallel), ``FSDPParam._get_grad_inner_tensor``
# redistributes its gradient to the parameter's placements on the non-data-parallel mesh
# dims before FSDP's reduce-scatter. A TP-replicated parameter (a ``SequenceParallel``
# norm weight, a router) gets a ``Partial`` gradient, so that redistribute is an
# all-reduce over the TP mesh, run in the gradient's dtype: ``param_dtype``, whatever
# ``reduce_dtype`` says (pytorch#190626). 2.15 gives the unsharded parameter
# ``grad_dtype=reduce_dtype`` (autograd casts before the redistribute); PR #190627
# casts at the top of ``_get_grad_inner_tensor``. Up to 2.14 the gradient-accumulation
# path alone reduces in ``reduce_dtype`` (``to_accumulated_grad_if_needed`` upcasts first).
TP_REDUCE_METHOD = ("FSDPParam", "_get_grad_inner_tensor")


def grad_inner_tensor_method() -> Callable | None:
    """``FSDPParam._get_grad_inner_tensor`` as FSDP calls it without the plugin's wrapper; None where missing."""
    owner = load_internals().symbols.get(TP_REDUCE_METHOD[0])
    method = getattr(owner, TP_REDUCE_METHOD[1], None)
    if not callable(method):
        return None
    return inspect.unwrap(method, stop=lambda fn: function_origin(fn) != "torch_fsdp_ext")


def tp_reduce_symbol_name() -> str:
    owner = load_internals().symbols.get(TP_REDUCE_METHOD[0])
    prefix = f"{owner.__module__}.{owner.__qualname__}" if owner is not None else TP_REDUCE_METHOD[0]
    return f"{prefix}.{TP_REDUCE_METHOD[1]}"


def reduces_outside_dp(fsdp_param: Any, grad: torch.Tensor) -> bool:
    """Will ``_get_grad_inner_tensor`` reduce ``grad`` over a mesh dim that is not data parallel?

    True where ``grad`` is a DTensor with a ``Partial`` placement on such a dim that the
    parameter's placements there are not: the redistribute is an all-reduce (to ``Replicate``)
    or a reduce-scatter (to ``Shard``). DP dims are left to FSDP's reduce-scatter (spmd meshes).
    The parameter's placements: ``_unsharded_dtensor_spec`` (2.12 on), ``_tp_spec`` on older releases.
    """
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None) or getattr(fsdp_param, "_tp_spec", None)
    placements = getattr(grad, "placements", None)
    if spec is None or placements is None or len(placements) != len(spec.placements):
        return False
    mesh_info = getattr(fsdp_param, "mesh_info", None)
    dp_dims = getattr(fsdp_param, "_dp_dim_indices", ()) if getattr(mesh_info, "is_spmd_mesh", False) else ()
    return any(
        placement.is_partial() and not target.is_partial()
        for i, (placement, target) in enumerate(zip(placements, spec.placements))
        if i not in dp_dims
    )


def _recording_partial_grad(dtype: torch.dtype, seen: list[torch.dtype]) -> torch.Tensor:
    """A stand-in DTensor gradient (no mesh, no process group), ``Partial`` on one mesh dim.

    It records the dtype in which it is redistributed; ``.to()`` gives another stand-in.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    class RecordingGrad(DTensor):
        @staticmethod
        def make(dtype: torch.dtype, placements: tuple) -> "RecordingGrad":
            grad = torch.Tensor._make_wrapper_subclass(RecordingGrad, (4,), dtype=dtype)
            grad._spec = types.SimpleNamespace(placements=placements, mesh=None, tensor_meta=None)
            grad._local_tensor = torch.zeros(4, dtype=dtype)
            return grad

        def to(self, dtype: torch.dtype, *args: Any, **kwargs: Any) -> "RecordingGrad":
            return RecordingGrad.make(dtype, self._spec.placements)

        def redistribute(self, device_mesh: Any = None, placements: Any = None, **kwargs: Any) -> "RecordingGrad":
            seen.append(self.dtype)
            if not all(isinstance(p, Replicate) for p in placements):
                raise AssertionError(f"redistributed to {placements}")
            return RecordingGrad.make(self.dtype, tuple(placements))

    return RecordingGrad.make(dtype, (Partial(),))


def _grad_probe_param(internals: TorchInternals) -> Any:
    """An ``FSDPParam`` from ``object.__new__`` with what its TP gradient path and unsharded init read:
    a parameter replicated on a 1-D TP mesh, ``param_dtype=bf16``, ``reduce_dtype=fp32``."""
    param = object.__new__(internals.FSDPParam)
    sharded = torch.nn.Parameter(torch.zeros(4))
    sharded._local_tensor = sharded.detach()  # read as the sharded DTensor's local tensor
    param.__dict__.update(
        is_dtensor=True, is_spmd_types=False, mesh_info=types.SimpleNamespace(is_spmd_mesh=False),
        _dp_dim_indices=frozenset(), _unsharded_dtensor_spec=None, sharded_param=sharded,
        orig_dtype=torch.float32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
        _has_sharded_grad_dtype_override=False, sharded_grad_dtype=torch.float32,
        all_gather_outputs=[torch.zeros(4, dtype=torch.bfloat16)], _orig_size=torch.Size([4]),
        _contiguous_orig_stride=(1,), _release_all_gather_outputs_after_post_all_gather=False,
    )
    return param


def _set_grad_probe_spec(param: Any) -> None:
    """After ``init_unsharded_param`` (which, given a spec, would build a DTensor on a mesh): the TP placements."""
    from torch.distributed.tensor import Replicate

    spec = types.SimpleNamespace(placements=(Replicate(),))
    param.__dict__.update(_unsharded_dtensor_spec=spec, _tp_spec=spec)


@functools.lru_cache(maxsize=None)
def probe_tp_grad_reduce_dtype() -> tuple[torch.dtype | None, str]:
    """The dtype in which this torch reduces a TP-replicated parameter's gradient over the TP mesh,
    under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; (None, why) where unknown.

    Two stand-ins, no process group: the gradient autograd would produce (bf16, unless
    ``init_unsharded_param`` gives the unsharded parameter a ``grad_dtype``, as 2.15 does) is
    handed to ``_get_grad_inner_tensor`` as a ``Partial`` DTensor that records the dtype of
    its redistribute (a cast there, as PR #190627 adds, is seen too).
    """
    internals = load_internals()
    get_grad_inner_tensor = grad_inner_tensor_method()
    if get_grad_inner_tensor is None:
        return None, f"{tp_reduce_symbol_name()} is missing"
    try:
        param = _grad_probe_param(internals)
        internals.FSDPParam.init_unsharded_param(param)
        unsharded = param.__dict__["_unsharded_param"]
        grad_dtype = getattr(unsharded, "grad_dtype", None) or unsharded.dtype
        _set_grad_probe_spec(param)
    except Exception as e:  # noqa: BLE001 - internals we do not understand
        return None, f"FSDPParam.init_unsharded_param differs: {e!r}"
    seen: list[torch.dtype] = []
    try:
        local = get_grad_inner_tensor(param, _recording_partial_grad(grad_dtype, seen))
    except Exception as e:  # noqa: BLE001
        return None, f"{tp_reduce_symbol_name()} differs: {e!r}"
    if len(seen) != 1 or not isinstance(local, torch.Tensor) or local.dtype != seen[0]:
        return None, f"{tp_reduce_symbol_name()} did not redistribute the Partial gradient once"
    return seen[0], "reduced in the gradient's dtype" if seen[0] == torch.bfloat16 else "reduced in reduce_dtype"
