"""Optimizer state made before a parameter was upcast.

Note: the upcast (Note [Upcast moment] in ``_dtype_fix``) happens after
``fully_shard`` and keeps the ``nn.Parameter`` object, so an optimizer that holds
it keeps stepping it. State the optimizer created before the cast (an
optimizer-only step-0 ``get_optimizer_state_dict``, a resumed optimizer checkpoint
loaded before the model's) keeps the old dtype, and the first step fails inside the
optimizer (AdamW: ``expected dtype torch.bfloat16 for 'end'`` in ``aten.lerp_``);
optimizer state loaded before the cast was also rounded to the old dtype. FSDP
cannot see optimizers and torch keeps no registry of them; the one place every
optimizer passes before it touches its state is torch.optim's global step
pre-hook. So the upcast parameters are remembered (weakly) and checked there, at
the next step of an optimizer that holds them, which raises naming them and the
fix before the optimizer runs; with nothing left to check it returns at once, and
``uninstall()`` removes it.

Note: the check costs O(parameters still to check) per step, not O(parameters of
the optimizer): each optimizer's parameter ids are collected once (again only when
its param groups change), and once nothing is left to check the hook reads one
module-level bool, which ``torch.compile`` traces without a graph break.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import _compat
from ._dtype_plan import MixedParamDtypeError, format_dtype

_lock = threading.Lock()
# nn.Parameter -> (a weak reference to its FSDPParam, the dtype it had before the upcast)
_upcast: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by identity: tensors compare elementwise
_hook_handle: Any = None
_awaiting_check = False  # _upcast is not empty: the hook's fast path reads only this
# optimizer -> (its param groups as seen, the ids of its parameters)
_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_upcast(fsdp_param: Any, dtype_before: torch.dtype) -> None:
    """Check the parameter's optimizer state at the next step of each optimizer that holds it."""
    global _hook_handle, _awaiting_check
    with _lock:
        _upcast[fsdp_param.sharded_param] = (weakref.ref(fsdp_param), dtype_before)
        _awaiting_check = True
        if _hook_handle is None:
            _hook_handle = register_optimizer_step_pre_hook(_check_before_step)


def _stale_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, dtype_before: torch.dtype) -> list[str]:
    """Names of ``param``'s state tensors shaped like it and still in its dtype from before the upcast."""
    state = optimizer.state.get(param) or {}
    return [
        key
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.dtype == dtype_before and value.shape == param.shape
    ]


def release() -> None:
    """At uninstall(): remove the hook unless a parameter is still to be checked."""
    global _hook_handle
    with _lock:
        if not _upcast and _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None


def _held_ids(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    groups = tuple((id(group), len(group["params"])) for group in optimizer.param_groups)
    cached = _held.get(optimizer)
    if cached is None or cached[0] != groups:
        cached = (groups, frozenset(id(p) for group in optimizer.param_groups for p in group["params"]))
        _held[optimizer] = cached
    return cached[1]


def _check_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _awaiting_check:
        return  # Note: not removed here: torch is iterating over the hooks
    _check_pending(optimizer)


def _check_pending(optimizer: torch.optim.Optimizer) -> None:
    global _awaiting_check
    with _lock:
        held = _held_ids(optimizer)
        stale, checked = [], []
        for param, (fsdp_param_ref, dtype_before) in list(_upcast.items()):
            if id(param) not in held:
                continue
            checked.append(param)
            keys = _stale_state(optimizer, param, dtype_before)
            if keys:
                fsdp_param = fsdp_param_ref()  # its FQN is known once the group's lazy init ran
                name = _compat.fsdp_param_name(fsdp_param, 0) if fsdp_param is not None else "<param>"
                stale.append((name, dtype_before, param.dtype, keys))
        if not stale:
            for param in checked:
                _upcast.pop(param, None)  # its state is created in its new dtype from now on
            if not _upcast:
                _awaiting_check = False
                _held.clear()
            return
    lines = [
        "torch_fsdp_ext: this optimizer holds state made before the plugin upcast these parameters to fp32 "
        "master weights; optimizer state loaded into it before the upcast was rounded to their old dtype:"
    ]
    for name, before, after, keys in stale:
        lines.append(f"  {name}: {format_dtype(before)} -> {format_dtype(after)}, state {', '.join(keys)} still "
                     f"{format_dtype(before)}")
    lines.append(
        "Fix: the plugin upcasts a model at its first forward or its first state_dict()/load_state_dict(); "
        "save and load the optimizer together with the model (get_state_dict(model, optimizer), "
        "set_state_dict(...)) or after a forward, then build the optimizer and load its state again."
    )
    raise MixedParamDtypeError("\n".join(lines))
