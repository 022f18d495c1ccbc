"""The torch-version layer: the only module that knows torch's private FSDP2 and
activation-checkpoint internals.

Every private symbol the fixes touch is listed in ``PRIVATE_SYMBOLS`` and resolved
here, once. Supporting a new torch release means editing this package only: this module holds
what every fix reads (the symbols, FSDP2's objects, other libraries' patches), and one module
per fix what only that fix reads and probes (``_dtype``, ``_recompute``, ``_reduce``).

Note: where behaviour differs between releases we *probe* it (call the private
function on a tiny stand-in object and look at what it did) instead of comparing
version strings. A probe that cannot run answers ``None`` ("unknown"); callers
treat unknown conservatively.
"""

from __future__ import annotations

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

# The symbols above that each fix needs: one missing sets aside only the fixes that need it. A class
# stands for all its methods; "Class.method" for that method alone (``_affects``).
FIX_SYMBOLS: dict[str, frozenset[str]] = {
    "dtype": frozenset({
        "FSDPParamGroup", "FSDPParam", "fsdp_param_group_module", "FSDPState", "MixedPrecisionPolicy",
        "module_state_mapping",
    }),
    "recompute": frozenset({
        "FSDPState", "TrainingState", "cast_fp_tensor", "MixedPrecisionPolicy", "apply_to_tensors", "to_kwargs",
        "checkpoint_hook", "recomputation_hook", "CheckpointFrame", "module_state_mapping",
    }),
    # The reduce fix needs only the group's lazy_init of FSDPParamGroup.
    "reduce": frozenset({"FSDPParamGroup.lazy_init", "FSDPParam", "MixedPrecisionPolicy"}),
}

# Methods that the fixes wrap, by the name used above.
WRAPPED_METHODS: tuple[tuple[str, str], ...] = (
    ("FSDPParamGroup", "__init__"),
    ("FSDPParamGroup", "_init_mp_dtypes"),
    ("FSDPParamGroup", "post_backward"),
    ("FSDPParamGroup", "lazy_init"),
    ("FSDPParam", "__init__"),
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
        return [what for what, owner in zip(self.hidden, self.hidden_owners) if _affects(owner, fix)]

    def missing_for(self, fix: str) -> list[str]:
        """What ``fix`` needs and this torch lacks (everything when there is no FSDP2 package)."""
        if self.fsdp_package is None:
            return list(self.missing)
        return [what for what, owner in zip(self.missing, self.missing_owners) if _affects(owner, fix)]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["symbols"][name]
        except KeyError:
            raise AttributeError(name) from None


def _affects(owner: str, fix: str) -> bool:
    """Does a missing or hidden ``owner`` (a symbol, or ``"Symbol.method"``) set aside ``fix``?"""
    if owner == "*":
        return True
    return any(
        owner == need or owner == need.split(".")[0] or need == owner.split(".")[0] for need in FIX_SYMBOLS[fix]
    )


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
            internals.note_missing(f"{cls.__name__}.{method}", f"{owner}.{method}")
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
                "FSDPParamGroup.__init__",
            )
        else:
            params = inspect.signature(own).parameters
            for argument in ("params", "mp_policy", "modules"):
                if argument not in params:
                    internals.note_missing(f"FSDPParamGroup.__init__ argument {argument!r}", "FSDPParamGroup.__init__")
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
    run (``tools/benchmarks/bench_instructions.py``).
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


# Note [Foreign patches]. Other libraries patch FSDP2's internals too (NeMo Automodel's
# ``patch_fsdp_uniform_reduce_dtype`` replaces ``foreach_reduce`` in ``_fsdp_collectives`` and
# ``_fsdp_param_group`` with a wrapper that widens a group's gradients, then calls torch's).
# A signature read on such a wrapper says nothing about torch, and a wrapper applied after the
# plugin's may drop it. So who owns a function is told by where its code lives (identity:
# ``__code__.co_filename`` under torch's package, under this plugin's, or elsewhere), never by
# its names or signature, which ``functools.wraps`` copies; torch's own function is found
# through what a wrapper keeps of it (``__wrapped__``, its closure, the global it calls).
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


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
        if not _affects(f"{owner}.{method}", fix):
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
# Tensor helpers the fixes share
# ---------------------------------------------------------------------------


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


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``input`` gathered along dim 0 into ``output`` (a public collective, under two names).

    Note: ``torch.distributed.all_gather_single`` is the name from 2.13 on, where ``all_gather_into_tensor``
    became its alias, deprecated with a FutureWarning on every call in 2.13 and 2.14; releases before 2.13
    have only ``all_gather_into_tensor``. The name is looked up, not the version compared.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)
