"""The reduce fix's interface: which of its parts this release needs, and installing them.

Note [Reduce parts]. ``ReduceFix`` holds a tuple of parts, each one failure of FSDP2's
gradient reduction that a torch release has or has not. A part is an object with

- ``name: str``: what it repairs, in a few words (``status()`` lists the parts by it);
- ``summary: str``: one line on what it does;
- ``needed() -> tuple[bool | None, str]``: whether this torch has the failure, by a behaviour
  probe in ``_compat`` (None: the probe could not tell, and the part stands aside), and why;
- ``install(patches: PatchSet) -> None``: wraps what it needs through ``patches`` and sets
  ``active`` (raising rolls back the whole fix); the parts that repair ``foreach_reduce``'s
  arguments wrap nothing themselves: the fix wraps it once for them (Note [One reduce wrapper]);
- ``active: bool``: cleared by ``uninstall()`` before the patches are restored, so that a
  wrapper still called (held by another library's wrapper put over it) passes straight through;
- ``wrapped_symbols() -> list[str]``: the torch functions it wraps, for ``status()``.

The fix is needed where any part is, and installs the parts that are. A part may need
another one installed with it (``installs_with``): the TP part leaves a group with gradients
of two dtypes, which the mixed-gradient part reduces.
"""

from __future__ import annotations

import functools

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet
from ._foreach_reduce import wrap_foreach_reduce
from ._frozen_first_forward import FrozenFirstForward
from ._grad_dtypes import MixedGradDtypes
from ._tp import TPAllReduceInReduceDtype


class ReduceFix:
    """The ``reduce`` fix."""

    name = "reduce"
    summary = "FSDP2's gradient reduction in mixed precision reduces in reduce_dtype, as torch 2.15 does"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.mixed_grad_dtypes = MixedGradDtypes(internals)
        self.frozen_first_forward = FrozenFirstForward(internals)
        self.parts = (self.mixed_grad_dtypes, self.frozen_first_forward, TPAllReduceInReduceDtype(internals))
        self.installs_with = {self.parts[2]: self.mixed_grad_dtypes}
        self._active = False

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
        # a needed part is named with its short cause, a part that cannot tell says why in full.
        needed = [f"{part.name} ({reason})" for part, answer, reason in answers if answer is True]
        if needed:
            return True, ", ".join(needed)
        unknown = [f"{part.name}: {reason}" for part, answer, reason in answers if answer is None]
        if unknown:
            return None, "; ".join(unknown)
        return False, "this torch reduces each of these cases in the reduce dtype itself"

    def parts_status(self) -> dict[str, str]:
        """Per part, who repairs it on this torch: ``torch_fsdp_ext``, ``upstream`` or ``unknown``."""
        who = {True: "torch_fsdp_ext", False: "upstream", None: "unknown"}
        return {part.name: who[part.needed()[0]] for part in self.parts}

    def parts_to_install(self) -> list:
        needed = [part for part in self.parts if part.needed()[0]]
        with_them = {self.installs_with[part] for part in needed if part in self.installs_with}
        return [part for part in self.parts if part in needed or part in with_them]

    def wrapped_symbols(self) -> list[str]:
        names = [name for part in self.parts_to_install() for name in part.wrapped_symbols()]
        return list(dict.fromkeys(names))

    def install(self, patches: PatchSet) -> None:
        parts = self.parts_to_install()
        for part in parts:
            part.install(patches)
        frozen = self.frozen_first_forward if self.frozen_first_forward in parts else None
        mixed = self.mixed_grad_dtypes if self.mixed_grad_dtypes in parts else None
        if frozen is not None or mixed is not None:
            positions = _compat_reduce.foreach_reduce_argument_positions()
            if positions is None:
                raise RuntimeError("torch's foreach_reduce has no unsharded_grads/reduce_dtype arguments")
            wrap = functools.partial(wrap_foreach_reduce, frozen, mixed, positions)
            patches.wrap(self.internals.fsdp_param_group_module, "foreach_reduce", wrap)
        self._active = True
