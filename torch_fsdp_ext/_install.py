"""install / uninstall / status: which fixes this torch needs, and switching them."""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from . import _compat
from ._dtype_fix import DtypeFix
from ._patching import PatchSet
from ._recompute import RecomputeReplay

FIX_NAMES = ("dtype", "recompute")

_lock = threading.RLock()
_active: dict[str, tuple[Any, PatchSet]] = {}  # fix name -> (fix, its patches)
_warned_unsupported = False


@dataclass
class FixStatus:
    name: str
    summary: str
    needed: bool | None  # None: this torch lacks the internals the fix needs
    reason: str
    active: bool
    wraps: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Status:
    torch_version: str
    supported: bool
    missing: list[str]
    fixes: dict[str, FixStatus]


def _make_fix(name: str, internals: _compat.TorchInternals, dtype_strategy: str) -> Any:
    if name == "dtype":
        return DtypeFix(internals, dtype_strategy)
    return RecomputeReplay(internals)


def _check_names(fixes: Iterable[str] | None) -> tuple[str, ...]:
    if fixes is None:
        return FIX_NAMES
    names = (fixes,) if isinstance(fixes, str) else tuple(fixes)
    unknown = [n for n in names if n not in FIX_NAMES]
    if unknown:
        raise ValueError(f"unknown fix(es) {unknown}; choose from {FIX_NAMES}")
    return names


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


def install(fixes: Iterable[str] | None = None, *, dtype_strategy: str = "upcast") -> list[str]:
    """Install the fixes this torch release needs (all by default); idempotent.

    ``dtype_strategy``: ``"upcast"`` keeps fp32 master weights; ``"preserve"`` trains
    each parameter in its own dtype; ``"error"`` only replaces FSDP's assertion with
    an error naming each parameter.
    Returns the names of the fixes active after the call.
    """
    names = _check_names(fixes)
    with _lock:
        internals = _compat.load_internals()
        if not internals.ok:
            _warn_unsupported(internals)
            return []
        for name in names:
            if name in _active:
                if name == "dtype":
                    _active[name][0].set_strategy(dtype_strategy)
                continue
            fix = _make_fix(name, internals, dtype_strategy)
            if not fix.needed()[0]:
                continue
            patches = PatchSet()
            try:
                fix.install(patches)
            except Exception as e:  # noqa: BLE001 - never break training over a patch
                fix.active = False
                patches.restore()
                warnings.warn(f"torch_fsdp_ext: could not install fix {name!r}: {e!r}", RuntimeWarning, stacklevel=2)
                continue
            _active[name] = (fix, patches)
        return [n for n in FIX_NAMES if n in _active]


def uninstall(fixes: Iterable[str] | None = None) -> None:
    """Remove installed fixes, restoring every patched torch attribute by identity."""
    names = _check_names(fixes)
    with _lock:
        for name in reversed(names):
            entry = _active.pop(name, None)
            if entry is not None:
                fix, patches = entry
                fix.active = False  # hooks bound while installed now pass straight through
                patches.restore()


@contextlib.contextmanager
def installed(fixes: Iterable[str] | None = None, *, dtype_strategy: str = "upcast") -> Iterator[list[str]]:
    """Context manager: the fixes are active inside; those it installed are removed on exit."""
    with _lock:
        before = set(_active)
        active = install(fixes, dtype_strategy=dtype_strategy)
    try:
        yield active
    finally:
        uninstall([n for n in active if n not in before])


def status() -> Status:
    """Per fix: is it needed on this torch (and why), is it active, what it wraps."""
    internals = _compat.load_internals()
    report = Status(torch.__version__, internals.ok, list(internals.missing), {})
    for name in FIX_NAMES:
        fix, patches = _active.get(name, (None, None))
        if fix is None and internals.ok:
            fix = _make_fix(name, internals, "upcast")
        if fix is None:
            report.fixes[name] = FixStatus(name, "", None, "unsupported torch: " + "; ".join(internals.missing), False)
            continue
        needed, reason = fix.needed()
        details: dict[str, Any] = {}
        if name == "dtype":
            details["strategy"] = fix.strategy.name
        else:
            details["replays"] = fix.replays()
            details["rebound_hooks"] = patches.rebound_hooks if patches is not None else 0
            details["not_covered"] = list(fix.not_covered)
        report.fixes[name] = FixStatus(
            name, fix.summary, needed, reason, patches is not None, fix.wrapped_symbols(), details
        )
    return report
