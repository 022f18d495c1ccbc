"""Reversible patches: every replaced attribute or hook is restored by identity."""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from . import _compat

_ABSENT = object()  # the attribute was inherited, not set on the owner itself

# Note [Buried patches]. Two fixes may wrap one attribute (``foreach_reduce``: the reduce fix at
# install, the dtype fix while a mixed group lives), and the one underneath may be restored
# first. Its wrapper cannot be taken out of the other's closure, so it stays there, passing
# straight through (its fix is no longer active), and what it replaced is noted here: the
# patch above it, when restored, puts that back instead of the buried wrapper.
_buried: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # buried replacement -> what it replaced


@dataclass
class _AttributePatch:
    owner: Any
    name: str
    original: Any  # the object found in owner.__dict__, or _ABSENT
    replacement: Any


@dataclass
class _HookPatch:
    hooks: dict
    hook_id: int
    original: Any
    replacement: Any


def wraps(original: Callable) -> Callable[[Callable], Callable]:
    """``functools.wraps`` without copying ``original.__dict__``.

    Note: torch marks some of the wrapped methods with dynamo attributes
    (``_torchdynamo_orig_callable``, ...); copying them onto our wrapper would let
    a compiler skip straight to the unwrapped original.
    """
    return functools.wraps(original, updated=())


class PatchSet:
    """Patches applied by one fix, undone in reverse order by ``restore()``."""

    def __init__(self) -> None:
        self._attributes: list[_AttributePatch] = []
        self._hooks: list[_HookPatch] = []
        self._undo_first: list[Callable[[], None]] = []
        self._handles: list[Any] = []

    def wrap(self, owner: Any, name: str, make_wrapper: Callable[[Any], Any], *, as_decorated: bool = False) -> None:
        """Replace ``owner.name`` with ``make_wrapper(current)``; ``current`` may be inherited.

        ``as_decorated``: when torch decorated ``current`` for dynamo, wrap the function it
        decorates and decorate the wrapper the same way, so that dynamo treats both alike.
        """
        original = owner.__dict__.get(name, _ABSENT)
        current = getattr(owner, name)
        decorated = _compat.dynamo_decorator(current) if as_decorated else None
        if decorated is None:
            replacement = make_wrapper(current)
        else:
            decorator, undecorated = decorated
            replacement = decorator(make_wrapper(undecorated))
        setattr(owner, name, replacement)
        # Recorded only once applied, so a rollback after a failed wrap undoes nothing it did not do.
        self._attributes.append(_AttributePatch(owner, name, original, replacement))

    def rebind_hook(self, hooks: dict, hook_id: int, replacement: types.MethodType) -> None:
        """Swap one registered module hook (a bound method) for ``replacement``."""
        self._hooks.append(_HookPatch(hooks, hook_id, hooks[hook_id], replacement))
        hooks[hook_id] = replacement

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` first on ``restore()``: for what a fix changes after install (e.g. per instance)."""
        self._undo_first.append(undo)

    def add_handle(self, handle: Any) -> None:
        """A hook registered through torch's public API (``RemovableHandle``), removed by ``restore()``."""
        self._handles.append(handle)

    @property
    def rebound_hooks(self) -> int:
        return len(self._hooks)

    def restore(self) -> None:
        for undo in reversed(self._undo_first):
            undo()
        self._undo_first.clear()
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for hook in reversed(self._hooks):
            # Only put the original back if nobody removed or replaced our hook since.
            if hook.hooks.get(hook.hook_id) is hook.replacement:
                hook.hooks[hook.hook_id] = hook.original
        self._hooks.clear()
        for patch in reversed(self._attributes):
            # Note: another library may have put its own patch over ours since (a wrapper of ours or its
            # own function). Putting the original back would drop that patch without a word; it stays,
            # and whoever restores it owns the attribute from then on.
            current = patch.owner.__dict__.get(patch.name, _ABSENT)
            if current is not patch.replacement and wraps_over(current, patch.replacement):
                _buried[patch.replacement] = patch.original
            elif current is not patch.replacement:
                warnings.warn(
                    f"torch_fsdp_ext: left {_attribute_name(patch.owner, patch.name)} as it is "
                    f"({_describe(current)}): something replaced the plugin's patch after it was applied, so "
                    "the original is not put back over it",
                    RuntimeWarning, stacklevel=2,
                )
            elif patch.original is _ABSENT:
                delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, _unburied(patch.original))
        self._attributes.clear()



def wraps_over(fn: Any, target: Any) -> bool:
    """Is ``fn`` a chain of this plugin's wrappers (``__wrapped__``) over ``target``?"""
    for _ in range(16):
        if fn is target:
            return True
        if _compat.function_origin(fn) != "torch_fsdp_ext":
            return False
        fn = getattr(fn, "__wrapped__", None)
    return False


def _unburied(original: Any) -> Any:
    """What ``original`` replaced, where it is a buried wrapper (Note [Buried patches])."""
    while original is not _ABSENT and original in _buried:
        original = _buried.pop(original)
    return original


def _attribute_name(owner: Any, name: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _describe(value: Any) -> str:
    if value is _ABSENT:
        return "no longer set there"
    fn = getattr(value, "__func__", value)
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
