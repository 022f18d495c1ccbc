"""The reduce fix's interface: which of its parts this release needs, and installing them.

Note [Reduce parts]. ``ReduceFix`` holds a tuple of parts, each a change of FSDP2's gradient
path that torch 2.15 has and a release before it may lack. A part is an object with

- ``name: str``: what it repairs, in a few words (``status()`` lists the parts by it);
- ``summary: str``: one line on what it does;
- ``needed() -> tuple[bool | None, str]``: whether this torch lacks the change, by a behaviour
  probe in ``_compat`` (None: the probe could not tell, and the part stands aside), and why;
- ``install(patches: PatchSet) -> None``: wraps what it needs through ``patches`` and sets
  ``active`` (raising rolls back the whole fix);
- ``active: bool``: cleared by ``uninstall()`` before the patches are restored, so that a
  wrapper still called (held by another library's wrapper put over it) passes straight through;
- ``wrapped_symbols() -> list[str]``: the torch functions it wraps, for ``status()``.

The fix wraps ``FSDPParamGroup.lazy_init`` once for the parts that act on a group (Note
[Until the first all-gather]). The fix is needed where any part is, and installs those that are.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

from .. import _compat
from .._patching import PatchSet, wraps
from ._fp32_reduction import Fp32Reduction
from ._grad_dtype import USER_GRAD_DTYPE_ATTR, GradDtypeAtBirth, forget_grad_dtype, give_grad_dtype
from ._never_ran import NeverRanUnits, to_accumulated_grad_if_needed
from ._user_grad_dtype import UserGradDtype

# Note [Until the first all-gather]: an ``FSDPParam``'s unsharded parameter is made once, by
# ``init_unsharded_param`` at its first all-gather, and kept for the model's life. Wrapping that
# method on the class would put a Python frame in front of every parameter of every all-gather.
# Instead, at its group's lazy init (or at install for groups alive then), each ``FSDPParam``
# without an unsharded parameter gets instance attributes: ``init_unsharded_param``, which runs
# the class's method, gives the new unsharded parameter its gradient dtype and removes the
# instance attributes, and, where needed, the guard of ``to_accumulated_grad_if_needed``
# (``_never_ran``). Each holds a weak reference to its ``FSDPParam``: no cycle. After a unit's
# first all-gather its parameters run torch's methods with no plugin code.
_INIT = "init_unsharded_param"
_TO_ACCUMULATED = "to_accumulated_grad_if_needed"


class ReduceFix:
    """The ``reduce`` fix."""

    name = "reduce"
    summary = "FSDP2's gradients are made, accumulated and reduced in reduce_dtype, as torch 2.15 does"

    def __init__(self, internals: _compat.TorchInternals, reduce_dtype: torch.dtype | None = None) -> None:
        self.internals = internals
        self.grad_dtype = GradDtypeAtBirth(internals)
        self.never_ran = NeverRanUnits(internals)
        self.user_grad_dtype = UserGradDtype(internals)
        self.fp32_reduction = Fp32Reduction(internals, reduce_dtype)
        self.parts = (self.grad_dtype, self.never_ran, self.user_grad_dtype, self.fp32_reduction)
        self._active = False
        # Groups whose parameters were given their instance attributes or gradient dtypes: a
        # group's lazy_init runs at every FSDPModule.unshard() call too, which then costs one lookup.
        self._attached: weakref.WeakSet = weakref.WeakSet()
        self._own_grad_dtypes: weakref.WeakSet = weakref.WeakSet()  # groups with a user grad_dtype
        self._lock = threading.Lock()  # ranks may run as threads in one process

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        if not value:
            for part in self.parts:
                part.active = False

    def needed(self) -> tuple[bool | None, str]:
        answers = [(part, *part.needed()) for part in self.parts]
        # Note: status prints "reduce: needed, because <reason>." and then which parts the plugin fixes;
        # a needed part gives its upstream change, a part that cannot tell says why in full.
        needed = [reason for part, answer, reason in answers if answer is True]
        if needed:
            return True, "this torch lacks " + ", ".join(needed).replace(", pytorch#", ", #")
        unknown = [f"{part.name}: {reason}" for part, answer, reason in answers if answer is None]
        if unknown:
            return None, "; ".join(unknown)
        return False, "this torch makes, accumulates and reduces gradients in reduce_dtype itself"

    def parts_status(self) -> dict[str, str]:
        """Per part, who provides it on this torch: ``torch_fsdp_ext``, ``upstream``, ``off`` or ``unknown``."""
        out = {}
        for part in self.parts:
            answer, _ = part.needed()
            if part is self.fp32_reduction:
                out[part.name] = "torch_fsdp_ext" if answer else "off"
            else:
                out[part.name] = {True: "torch_fsdp_ext", False: "upstream", None: "unknown"}[answer]
        return out

    def parts_to_install(self) -> list:
        needed = [part for part in self.parts if part.needed()[0]]
        if self.fp32_reduction in needed and self.grad_dtype.needed()[0] and self.grad_dtype not in needed:
            needed.append(self.grad_dtype)
        return [part for part in self.parts if part in needed]

    def wrapped_symbols(self) -> list[str]:
        names = [name for part in self.parts_to_install() for name in part.wrapped_symbols()]
        return list(dict.fromkeys(names))

    def install(self, patches: PatchSet) -> None:
        parts = self.parts_to_install()
        for part in parts:
            part.install(patches)
        if parts:
            patches.wrap(self.internals.FSDPParamGroup, "lazy_init", functools.partial(wrap_group_lazy_init, self))
            patches.on_restore(self.detach_all)
        self._active = True
        for state in _compat.fsdp_states():
            for group in _compat.param_groups_of(state):
                if self.fp32_reduction.active and "_reduce_dtype" in group.__dict__:
                    # Note: its lazy init already resolved the dtypes from the user's policy; this is
                    # that step again (every FSDPModule.unshard() runs it too).
                    self.fp32_reduction.before_lazy_init(group)
                    group._init_mp_dtypes()
                self.after_lazy_init(group)

    def before_lazy_init(self, group: Any) -> None:
        if self.fp32_reduction.active:
            self.fp32_reduction.before_lazy_init(group)

    def after_lazy_init(self, group: Any) -> None:
        if group not in self._attached:
            with self._lock:
                if group not in self._attached:
                    self._attach(group)
        if group in self._own_grad_dtypes:
            self.user_grad_dtype.at_lazy_init(group)

    def _attach(self, group: Any) -> None:
        """Note [Until the first all-gather]."""
        births = self.grad_dtype.active or self.user_grad_dtype.active
        for fsdp_param in group.fsdp_params:
            if USER_GRAD_DTYPE_ATTR in fsdp_param.__dict__:
                self._own_grad_dtypes.add(group)
            unsharded = fsdp_param.__dict__.get("_unsharded_param")
            if unsharded is not None:
                if births:
                    give_grad_dtype(fsdp_param, unsharded)
                continue
            ref = weakref.ref(fsdp_param)
            fsdp_param.__dict__[_INIT] = functools.partial(init_unsharded_param_once, self, ref)
            if self.never_ran.active:
                fsdp_param.__dict__[_TO_ACCUMULATED] = functools.partial(to_accumulated_grad_if_needed, ref)
        self._attached.add(group)

    def detach_all(self) -> None:
        """``uninstall()``: no instance attribute left; unsharded parameters make gradients in their own dtype."""
        with self._lock:
            for group in list(self._attached):
                for fsdp_param in group.fsdp_params:
                    _remove_instance_attributes(fsdp_param)
                    unsharded = fsdp_param.__dict__.get("_unsharded_param")
                    if unsharded is not None:
                        forget_grad_dtype(unsharded)
            self._attached.clear()
            self._own_grad_dtypes.clear()


def _remove_instance_attributes(fsdp_param: Any) -> None:
    for name in (_INIT, _TO_ACCUMULATED):
        attribute = fsdp_param.__dict__.get(name)
        if isinstance(attribute, functools.partial) and attribute.func in (
            init_unsharded_param_once, to_accumulated_grad_if_needed
        ):
            del fsdp_param.__dict__[name]


def init_unsharded_param_once(fix: ReduceFix, fsdp_param_ref: weakref.ref) -> None:
    """An ``FSDPParam``'s ``init_unsharded_param`` until its unsharded parameter exists (Note [Until the first
    all-gather]): the class's method, as found now, then the new parameter's gradient dtype."""
    fsdp_param = fsdp_param_ref()
    type(fsdp_param).init_unsharded_param(fsdp_param)
    unsharded = fsdp_param.__dict__.get("_unsharded_param")
    if unsharded is None:
        return
    _remove_instance_attributes(fsdp_param)
    if fix.grad_dtype.active or fix.user_grad_dtype.active:
        give_grad_dtype(fsdp_param, unsharded)


def wrap_group_lazy_init(fix: ReduceFix, original: Callable) -> Callable:
    @wraps(original)
    def lazy_init(group: Any, *args: Any, **kwargs: Any) -> Any:
        if fix.active:
            fix.before_lazy_init(group)
        result = original(group, *args, **kwargs)
        if fix.active:
            fix.after_lazy_init(group)
        return result

    return lazy_init
