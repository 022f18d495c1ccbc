"""The TP all-reduce of a DTensor gradient in ``reduce_dtype`` (pytorch#190626).

Under FSDP2 + tensor parallel, a TP-replicated parameter (a ``SequenceParallel`` norm
weight, a router) gets a ``Partial`` gradient; FSDP redistributes it to ``Replicate``
(an all-reduce over the TP mesh) before its reduce-scatter, in the gradient's dtype. With
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` that all-reduce ran in bf16
up to 2.14, silently: contributions 1.0 and 2**-10 sum to 1.0, not 1.0009765625. As 2.15
does (it gives the unsharded parameter ``grad_dtype=reduce_dtype``), the gradient is cast
to ``reduce_dtype`` before the redistribute; gradients reduced over data parallel only
keep their dtype until FSDP's copy-in, as 2.15 defers their upcast too. A group then holds
gradients of two dtypes, which ``foreach_reduce`` up to 2.14 refuses: the mixed-gradient part
(``_grad_dtypes``) brings them to ``reduce_dtype``, as 2.15's copy-in does (``_fix`` installs it
with this part).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

from .. import _compat
from .._compat import _reduce as _compat_reduce
from .._patching import PatchSet, wraps

# Note [TP parameters only]: ``_get_grad_inner_tensor`` runs once per parameter per reduce.
# Wrapping it on the class would put a Python frame in front of every parameter of every
# model, although only a DTensor parameter (tensor parallel) can need the cast. The part
# therefore gives each DTensor ``FSDPParam`` an instance attribute of that name, at its
# group's ``lazy_init`` (and at install for groups alive then); every other parameter
# calls torch's method as it did. The attribute holds a weak reference to its parameter:
# no cycle through the FSDPParam, which lives as long as its model.
_METHOD = _compat_reduce.TP_REDUCE_METHOD[1]


class TPAllReduceInReduceDtype:
    """A part of the ``reduce`` fix: the non-data-parallel reduction of a DTensor gradient in ``reduce_dtype``."""

    name = "TP all-reduce"
    summary = "a TP-replicated parameter's gradient is all-reduced over the TP mesh in reduce_dtype"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False
        # Groups whose DTensor parameters have the instance attribute: FSDPModule.unshard() runs a
        # group's lazy_init on every call, which then costs one lookup, not a walk of its parameters.
        self._attached: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()  # ranks may run as threads in one process

    def needed(self) -> tuple[bool | None, str]:
        dtype, why = _compat_reduce.probe_tp_grad_reduce_dtype()
        if dtype is None:
            return None, f"torch's internals changed ({why}); the TP all-reduce part stands aside"
        if dtype == torch.float32:
            return False, "this torch all-reduces a TP-replicated parameter's gradient in reduce_dtype"
        return True, "in param_dtype, pytorch#190626"

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("FSDPParamGroup.lazy_init",))

    def install(self, patches: PatchSet) -> None:
        patches.wrap(self.internals.FSDPParamGroup, "lazy_init", functools.partial(wrap_group_lazy_init, self))
        patches.on_restore(self.detach_all)
        self.active = True
        for state in _compat.fsdp_states():
            for group in _compat.param_groups_of(state):
                self.attach(group)

    def attach(self, group: Any) -> None:
        """Give ``group``'s DTensor parameters the casting ``_get_grad_inner_tensor`` (Note [TP parameters only])."""
        if group in self._attached:
            return
        with self._lock:
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "is_dtensor", False):
                    setattr(fsdp_param, _METHOD, functools.partial(grad_inner_tensor_in_reduce_dtype, self,
                                                                   weakref.ref(fsdp_param)))
            self._attached.add(group)

    def detach_all(self) -> None:
        with self._lock:
            for group in list(self._attached):
                for fsdp_param in group.fsdp_params:
                    method = getattr(fsdp_param, _METHOD, None)
                    if isinstance(method, functools.partial) and method.func is grad_inner_tensor_in_reduce_dtype:
                        delattr(fsdp_param, _METHOD)
            self._attached.clear()


def wrap_group_lazy_init(part: TPAllReduceInReduceDtype, original: Callable) -> Callable:
    @wraps(original)
    def lazy_init(group: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(group, *args, **kwargs)
        if part.active:
            part.attach(group)
        return result

    return lazy_init


def grad_inner_tensor_in_reduce_dtype(
    part: TPAllReduceInReduceDtype, fsdp_param_ref: weakref.ref, grad: torch.Tensor
) -> torch.Tensor:
    """A DTensor parameter's ``_get_grad_inner_tensor``: its gradient cast to ``reduce_dtype`` where it is
    reduced over a mesh dim that is not data parallel, then torch's method (the class's, as found now)."""
    fsdp_param = fsdp_param_ref()
    # Note: the cast keeps the DTensor's placements (``Partial`` stays ``Partial``), so the
    # redistribute that follows reduces in ``reduce_dtype``; bf16 -> fp32 is exact: each rank
    # contributes what it did.
    if part.active and type(grad) is not torch.Tensor:
        reduce_dtype = fsdp_param.reduce_dtype
        if reduce_dtype not in (None, grad.dtype) and _compat_reduce.reduces_outside_dp(fsdp_param, grad):
            grad = grad.to(reduce_dtype)
    return getattr(type(fsdp_param), _METHOD)(fsdp_param, grad)
