"""install / uninstall / status: which fixes this torch needs, and switching them."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from . import _compat, _env
from ._dtype import DtypeFix, _compute_dtype
from ._dtype._strategies import STRATEGIES, UPCAST_COST
from ._failures import FAILURES
from ._patching import PatchSet, wraps
from ._recompute import RecomputeReplay
from ._reduce import ReduceFix

FIX_NAMES = tuple(FAILURES)

# Note [Armed]. A fix wraps FSDP2's own functions at install(). What it wraps of torch outside FSDP2
# (``outside_fsdp_symbols()``: ``Optimizer.add_param_group``, the checkpoint hooks every non-reentrant
# region runs, DCP's state-dict functions) runs for code that never uses FSDP2, and is needed only once
# an FSDP2 group exists: those wrappers are armed, and ``install_outside_fsdp(patches)`` puts them in at
# the first ``FSDPState.init`` (the start of every ``fully_shard``, before it builds a group) or at
# install() itself where a model is sharded already. Every moment the fixes act on (an optimizer taking a
# group's parameters, a DCP call on a sharded model, a checkpointed region around an FSDP2 module) comes
# after that. A process that never calls ``fully_shard`` runs torch's own functions there, and a fix
# without such wrappers (no ``install_outside_fsdp``) arms nothing. What is armed goes through the fix's
# own PatchSet, so uninstall() restores it with the rest.

# Note: ``importlib.reload`` re-runs this module in the same namespace. What is
# installed is kept across a reload, so that ``install()`` after it finds the
# patches applied before it (no second wrapper layer) and ``uninstall()`` removes them.
_lock: threading.RLock = globals().get("_lock") or threading.RLock()
_active: dict[str, tuple[Any, PatchSet]] = globals().get("_active", {})  # fix name -> (fix, its patches)
_armed: dict[str, None] = globals().get("_armed", {})  # active fixes whose wrappers outside FSDP2 wait (Note [Armed])
# The dtype strategy of an install() that names none: TORCH_FSDP_EXT_DTYPE_STRATEGY, else "upcast".
_dtype_strategy: str = globals().get("_dtype_strategy", "upcast")
# The gradient reduction setting: torch.float32 (TORCH_FSDP_EXT_REDUCE_DTYPE=float32), or None for each policy's own.
_reduce_dtype: torch.dtype | None = globals().get("_reduce_dtype")
REDUCE_DTYPES = {"float32": torch.float32, "none": None}
_warned_unsupported = False
_warned_stands_aside: set[str] = set()  # fixes whose probes failed, warned about once
_warned_foreign: set[str] = set()  # functions replaced by another library, warned about once


@dataclass
class FixStatus:
    name: str
    summary: str
    needed: bool | None  # None: this torch lacks the internals the fix needs
    reason: str
    active: bool
    wraps: list[str] = field(default_factory=list)  # torch functions it wraps now
    armed: list[str] = field(default_factory=list)  # those outside FSDP2 it wraps at the first fully_shard
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Status:
    torch_version: str
    supported: bool
    missing: list[str]
    fixes: dict[str, FixStatus]

    def __str__(self) -> str:
        from ._report import status_text

        return status_text(self)


def _make_fix(name: str, internals: _compat.TorchInternals, dtype_strategy: str) -> Any:
    if name == "dtype":
        fix = DtypeFix(internals, dtype_strategy)
        fix.ranks.installed_fixes = _installed_names  # the ranks compare them with their dtype layouts
        return fix
    if name == "reduce":
        return ReduceFix(internals, _reduce_dtype)
    return RecomputeReplay(internals)


def _installed_names() -> tuple[str, ...]:
    """The fixes installed, as the ranks compare them; the fp32 reduction setting counts as one (a rank that
    reduces in another dtype than its peers would hand the collective buffers of another size)."""
    names = tuple(n for n in FIX_NAMES if n in _active)
    return names + ("reduce_dtype=float32",) if "reduce" in names and _reduce_dtype is not None else names


def _check_names(fixes: Iterable[str] | None) -> tuple[str, ...]:
    if fixes is None:
        return FIX_NAMES
    names = (fixes,) if isinstance(fixes, str) else tuple(fixes)
    unknown = [n for n in names if n not in FIX_NAMES]
    if unknown:
        strategies = [n for n in unknown if isinstance(n, str) and n.strip().lower() in STRATEGIES]
        hint = f"; {strategies[0]!r} is a dtype strategy: install(dtype_strategy={strategies[0]!r})" if strategies else ""
        raise ValueError(f"torch_fsdp_ext: unknown fix(es) {unknown}; choose from {FIX_NAMES}{hint}")
    return names


def _parse_strategy(dtype_strategy: str | None) -> str | None:
    """The strategy as named (any case, spaces ignored), or None to keep the current one."""
    if dtype_strategy is None:
        return None
    return _env.parse_choice(dtype_strategy, STRATEGIES, "dtype_strategy")


def _set_dtype_strategy(dtype_strategy: str) -> None:
    global _dtype_strategy
    _dtype_strategy = dtype_strategy
    if "dtype" in _active:
        _active["dtype"][0].set_strategy(dtype_strategy)


def set_default_dtype_strategy(dtype_strategy: str | None) -> None:
    """The strategy for an ``install()`` that names none (from the environment at import); None: unchanged."""
    dtype_strategy = _parse_strategy(dtype_strategy)
    if dtype_strategy is not None:
        with _lock:
            _set_dtype_strategy(dtype_strategy)


def _parse_reduce_dtype(reduce_dtype: Any) -> Any:
    """``torch.float32`` or ``None`` (each policy's own) as named; ``...`` (not given) keeps the current one."""
    if reduce_dtype is ... or isinstance(reduce_dtype, torch.dtype) and reduce_dtype == torch.float32:
        return reduce_dtype
    if reduce_dtype is None:
        return None
    name = str(reduce_dtype).replace("torch.", "") if isinstance(reduce_dtype, torch.dtype) else reduce_dtype
    return REDUCE_DTYPES[_env.parse_choice(name, REDUCE_DTYPES, "reduce_dtype")]


def set_default_reduce_dtype(reduce_dtype: str | None) -> None:
    """The reduction setting from the environment at import (None: unset, each policy's own)."""
    global _reduce_dtype
    if reduce_dtype is not None:
        _reduce_dtype = REDUCE_DTYPES[reduce_dtype]


def _set_reduce_dtype(reduce_dtype: torch.dtype | None) -> None:
    """A new reduction setting: an installed reduce fix is installed again with it."""
    global _reduce_dtype
    if reduce_dtype == _reduce_dtype:
        return
    _reduce_dtype = reduce_dtype
    if "reduce" in _active:
        uninstall(["reduce"])
        install(["reduce"])


def _warn_unsupported(internals: _compat.TorchInternals) -> None:
    global _warned_unsupported
    if not _warned_unsupported:
        _warned_unsupported = True
        warnings.warn(
            f"torch_fsdp_ext: torch {torch.__version__} lacks FSDP2 internals this plugin needs "
            f"({'; '.join(internals.missing)}); nothing is patched and torch behaves as without the plugin.",
            RuntimeWarning,
            stacklevel=3,
        )


def install(
    fixes: Iterable[str] | None = None, *, dtype_strategy: str | None = None, reduce_dtype: Any = ...
) -> list[str]:
    """Install the fixes this torch release needs (all by default); idempotent.

    ``dtype_strategy`` (one of ``STRATEGIES``, any case): ``"upcast"`` keeps fp32 master
    weights; ``"preserve"`` trains each parameter in its own dtype; ``"error"`` only
    replaces FSDP's assertion with an error naming each parameter. It is a setting
    of the plugin, kept for later installs and applied to an active dtype fix
    whichever fixes are named; ``None`` keeps the current one
    (``TORCH_FSDP_EXT_DTYPE_STRATEGY`` at import, else ``"upcast"``).
    ``reduce_dtype=torch.float32`` (or ``"float32"``): every ``fully_shard`` policy whose
    ``reduce_dtype`` is unset or 16-bit accumulates and reduces gradients in fp32; ``None``:
    each policy's own (the default; ``TORCH_FSDP_EXT_REDUCE_DTYPE`` at import). A setting of
    the plugin like the strategy; not given: unchanged.
    Returns the names of the fixes active after the call.
    """
    names = _check_names(fixes)
    dtype_strategy = _parse_strategy(dtype_strategy)
    reduce_dtype = _parse_reduce_dtype(reduce_dtype)
    with _lock:
        if dtype_strategy is not None:
            _set_dtype_strategy(dtype_strategy)
        if reduce_dtype is not ...:
            _set_reduce_dtype(reduce_dtype)
        internals = _compat.load_internals()
        if internals.fsdp_package is None:
            _warn_unsupported(internals)
            _note_dtype_fix(internals)
            return []
        # Read before this install's own wrappers cover what it found; said only for the fixes it installs.
        foreign = {name: _compat.foreign_patches(name) for name in names if name not in _active}
        for name in names:
            if name in _active:
                continue
            lacking = internals.missing_for(name)
            if lacking:
                # This fix alone stands aside: the others install as they would.
                if name not in _warned_stands_aside:
                    _warned_stands_aside.add(name)
                    warnings.warn(
                        f"torch_fsdp_ext: fix {name!r} not installed: torch {torch.__version__} lacks "
                        f"{'; '.join(lacking)}; torch behaves as without this fix.",
                        RuntimeWarning, stacklevel=2,
                    )
                continue
            hidden = internals.hidden_for(name)
            if hidden:
                # Note [Foreign patches] in ``_compat``: named as another library's, never as torch's.
                if name not in _warned_stands_aside:
                    _warned_stands_aside.add(name)
                    warnings.warn(f"torch_fsdp_ext: fix {name!r} not installed: {'; '.join(hidden)}.",
                                  RuntimeWarning, stacklevel=2)
                continue
            fix = _make_fix(name, internals, _dtype_strategy)
            needed, reason = fix.needed()
            if needed is None and name not in _warned_stands_aside:
                # This fix alone stands aside: the others install as they would.
                _warned_stands_aside.add(name)
                warnings.warn(f"torch_fsdp_ext: fix {name!r} not installed: {reason}", RuntimeWarning, stacklevel=2)
            if not needed:
                continue
            patches = PatchSet()
            try:
                fix.install(patches)
                if hasattr(fix, "install_outside_fsdp"):
                    patches.wrap(internals.FSDPState, "init", functools.partial(_wrap_first_state_init, name))
            except Exception as e:  # noqa: BLE001 - never break training over a patch
                fix.active = False
                patches.restore()
                warnings.warn(f"torch_fsdp_ext: could not install fix {name!r}: {e!r}", RuntimeWarning, stacklevel=2)
                continue
            _active[name] = (fix, patches)
            if hasattr(fix, "install_outside_fsdp"):
                _armed[name] = None
        if _armed and _compat.fsdp_states():
            install_armed()  # a model was sharded before this install
        if "dtype" in _active:
            _active["dtype"][0].decide_existing_groups()
        _note_dtype_fix(internals)
        _warn_foreign_patches([f for name, found in foreign.items() if name in _active for f in found])
        return [n for n in FIX_NAMES if n in _active]


def _wrap_first_state_init(name: str, original: Any) -> Any:
    """Note [Armed]: ``FSDPState.init`` installs the armed wrappers first; then one dict lookup per ``fully_shard``."""

    @wraps(original)
    def init(state: Any, *args: Any, **kwargs: Any) -> None:
        if name in _armed:
            install_armed()
        return original(state, *args, **kwargs)

    return init


def install_armed() -> None:
    """Note [Armed]: an FSDP2 state exists: every armed fix installs its wrappers outside FSDP2.

    Note: under the lock of install()/uninstall(), so that a thread whose ``fully_shard`` returned finds
    them in place, whichever rank thread came first.
    """
    with _lock:
        for name in [n for n in FIX_NAMES if n in _armed]:
            del _armed[name]
            fix, patches = _active[name]
            try:
                fix.install_outside_fsdp(patches)
            except Exception as e:  # noqa: BLE001 - never break training over a patch
                warnings.warn(f"torch_fsdp_ext: could not install fix {name!r}: {e!r}", RuntimeWarning, stacklevel=2)
                uninstall([name])


def _warn_foreign_patches(found: list[str]) -> None:
    """Note [Foreign patches] in ``_compat``: a function another library replaced is named once, at install."""
    foreign = [f for f in dict.fromkeys(found) if f not in _warned_foreign]
    if foreign:
        _warned_foreign.update(foreign)
        warnings.warn(
            f"torch_fsdp_ext: another library replaced FSDP2 functions this plugin wraps: {'; '.join(foreign)}. "
            "The plugin wraps them as it found them; that composition is untested (docs/compatibility.md lists "
            "the patches known to compose exactly).",
            RuntimeWarning, stacklevel=3,
        )


def _note_dtype_fix(internals: _compat.TorchInternals) -> None:
    """Tell ``_compute_dtype`` whether the dtype fix is active and, if not, why (its policy checks it)."""
    if "dtype" in _active:
        reason = None
    elif internals.missing_for("dtype"):
        reason = "unsupported torch: " + "; ".join(internals.missing_for("dtype"))
    elif internals.hidden_for("dtype"):
        reason = "; ".join(internals.hidden_for("dtype"))
    else:
        needed, why = _make_fix("dtype", internals, _dtype_strategy).needed()
        reason = "not installed" if needed else why
    _compute_dtype.note_dtype_fix(reason)


def uninstall(fixes: Iterable[str] | None = None) -> None:
    """Remove installed fixes, restoring every patched torch attribute by identity."""
    names = _check_names(fixes)
    with _lock:
        for name in reversed(names):
            entry = _active.pop(name, None)
            _armed.pop(name, None)
            if entry is not None:
                fix, patches = entry
                fix.active = False  # hooks bound while installed now pass straight through
                patches.restore()
                if name == "dtype":
                    fix.release()  # what live preserve groups need stays until they are gone
        _note_dtype_fix(_compat.load_internals())


@contextlib.contextmanager
def installed(
    fixes: Iterable[str] | None = None, *, dtype_strategy: str | None = None, reduce_dtype: Any = ...
) -> Iterator[list[str]]:
    """Context manager: the fixes are active inside; on exit the fixes and the
    dtype strategy are exactly what they were before it."""
    with _lock:
        before, strategy_before, reduce_dtype_before = set(_active), _dtype_strategy, _reduce_dtype
        active = install(fixes, dtype_strategy=dtype_strategy, reduce_dtype=reduce_dtype)
    try:
        yield active
    finally:
        with _lock:
            uninstall([n for n in FIX_NAMES if n in _active and n not in before])
            _set_dtype_strategy(strategy_before)
            _set_reduce_dtype(reduce_dtype_before)
            missing = [n for n in FIX_NAMES if n in before and n not in _active]
            if missing:
                install(missing)


def upcast_now(model: torch.nn.Module) -> list[str]:
    """Give ``model`` (its FSDP root, after ``fully_shard`` and after its weights are loaded) its fp32
    master weights now, rather than when an optimizer first takes its parameters or at its first
    forward or state-dict call: for code that needs the final dtypes before that (an EMA copy,
    parameter groups by dtype, a memory budget).

    Returns the names of the parameters upcast by this call: none when the model is uniform,
    was upcast already, its first forward ran, the strategy is not ``upcast`` or the dtype fix
    is not active (this torch accepts mixed dtypes, or the plugin is uninstalled).
    Raises ``ValueError`` while a trainable parameter is still on the meta device, and
    ``MixedParamDtypeError`` (casting nothing) when a group cannot be made uniform.
    """
    with _lock:
        entry = _active.get("dtype")
    return entry[0].upcast_now(model) if entry is not None else []


def build_param_group(init: Any, group: Any, *args: Any, **kwargs: Any) -> None:
    """Build ``group`` with torch's ``FSDPParamGroup.__init__`` (``init``) through the dtype fix's hook when
    it is active: for the autoload stand-in (``torch_fsdp_ext_startup``) that another library wrapped."""
    entry = _active.get("dtype")
    if entry is None:
        init(group, *args, **kwargs)
    else:
        entry[0].build_group(init, group, *args, **kwargs)


def status() -> Status:
    """Per fix: is it needed on this torch (and why), is it active, what it wraps."""
    internals = _compat.load_internals()
    report = Status(torch.__version__, internals.ok, list(internals.missing), {})
    for name in FIX_NAMES:
        fix, patches = _active.get(name, (None, None))
        lacking = internals.missing_for(name)
        hidden = internals.hidden_for(name)
        if fix is None and not lacking and not hidden:
            fix = _make_fix(name, internals, _dtype_strategy)
        if fix is None:
            reason = "unsupported torch: " + "; ".join(lacking) if lacking else "; ".join(hidden)
            report.fixes[name] = FixStatus(name, "", None, reason, False)
            continue
        needed, reason = fix.needed()
        details: dict[str, Any] = {}
        if name == "dtype":
            details["strategy"] = fix.strategy.name
            details["upcast"] = {"params": UPCAST_COST.params, "bytes": UPCAST_COST.bytes}
        elif name == "reduce":
            details["parts"] = fix.parts_status()
            details["reduce_dtype"] = "float32" if _reduce_dtype is not None else "each policy's own"
        else:
            details["replays"] = fix.replays()
            details["rebound_hooks"] = patches.rebound_hooks if patches is not None else 0
            details["not_covered"] = list(fix.not_covered)
        now, armed = _wrapped_now(name, fix, internals) if patches is not None else ([], [])
        report.fixes[name] = FixStatus(name, fix.summary, needed, reason, patches is not None, now, armed, details)
    return report


def _wrapped_now(name: str, fix: Any, internals: _compat.TorchInternals) -> tuple[list[str], list[str]]:
    """An active fix's torch functions wrapped now, and those armed (Note [Armed])."""
    outside = fix.outside_fsdp_symbols() if hasattr(fix, "install_outside_fsdp") else []
    first_state = _compat.symbol_names(internals, ("FSDPState.init",)) if outside else []
    now = list(dict.fromkeys(fix.wrapped_symbols() + first_state))
    if name in _armed:
        return now, outside
    return now + outside, []
