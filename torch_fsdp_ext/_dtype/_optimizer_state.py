"""Optimizers and the upcast moment.

Note [Optimizers see the upcast]. The upcast (Note [Upcast moment] in
``_fix``) happens after ``fully_shard`` and keeps each ``nn.Parameter``
object, so an optimizer that holds one keeps stepping the parameter the model
uses. What must not happen is optimizer state made while a parameter is still in
its loaded dtype: Adagrad's constructor state, the zero-lr step with which
``get_optimizer_state_dict`` initialises state, a checkpoint loaded into it (rounded
to bf16 on the way in, and cast back to fp32 without a trace by
``Optimizer.load_state_dict``). So the model's upcast comes first:

- every optimizer receives its parameters through ``Optimizer.add_param_group``
  (its constructor calls it): a model whose parameters an optimizer takes is
  upcast right there, before the optimizer can make state for them;
- ``torch.distributed.checkpoint.state_dict`` reaches optimizers through two
  module-level functions that take the model (``_compat.state_dict_entry_points``);
  the model is upcast before them, whichever order the user saves or loads in.

A model still on the meta device cannot be upcast then; it is upcast later (its
first forward at the latest). State an optimizer made before that is caught at its
next step by torch.optim's global step pre-hook, which raises naming the
parameters before the optimizer runs; with nothing left to check it returns at
once, and ``uninstall()`` removes it.

Note: nothing here holds a weak reference to a parameter: ``torch.utils.swap_tensors``
(``Module.to``, ``float()``, ``cpu()`` on DTensor parameters) refuses a tensor that
has one. Parameters are remembered by ``id`` beside a weak reference to their
``FSDPParam``, whose death forgets them.

Note: the step check costs O(parameters still to check) per step, not O(parameters of
the optimizer): each optimizer's parameter ids are collected once (again only when
its param groups change), and once nothing is left to check the hook reads one
module-level bool, which ``torch.compile`` traces without a graph break.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _compat
from ._plan import MixedParamDtypeError, format_dtype
from .._patching import PatchSet, wraps

_lock = threading.Lock()
# id(sharded nn.Parameter) -> (a weak reference to its FSDPParam, the dtype it had before the upcast,
# whether its model was sharded before the plugin was installed)
_upcast: dict[int, tuple[weakref.ref, torch.dtype, bool]] = {}
_hook_handle: Any = None
_awaiting_check = False  # _upcast is not empty: the hook's fast path reads only this
# optimizer -> (its param groups as seen, the ids of its parameters)
_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrap_add_param_group(patches: PatchSet, upcast_models_holding: Callable[[list], None]) -> None:
    """Note [Optimizers see the upcast]: ``upcast_models_holding(params)`` before an optimizer holds ``params``."""

    def make_wrapper(original: Callable) -> Callable:
        @wraps(original)
        def add_param_group(optimizer: torch.optim.Optimizer, param_group: dict) -> None:
            original(optimizer, param_group)
            upcast_models_holding(optimizer.param_groups[-1]["params"])

        return add_param_group

    patches.wrap(torch.optim.Optimizer, "add_param_group", make_wrapper)


def remember_upcast(fsdp_param: Any, dtype_before: torch.dtype, sharded_before_install: bool = False) -> None:
    """Check the parameter's optimizer state at the next step of each optimizer that holds it."""
    global _hook_handle, _awaiting_check
    key = id(fsdp_param.sharded_param)
    with _lock:
        _upcast[key] = (
            weakref.ref(fsdp_param, lambda _, key=key: _forget(key)), dtype_before, sharded_before_install
        )
        _awaiting_check = True
        if _hook_handle is None:
            _hook_handle = register_optimizer_step_pre_hook(_check_before_step)


def _forget(key: int) -> None:
    with _lock:
        _upcast.pop(key, None)


def _stale_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, dtype_before: torch.dtype) -> list[str]:
    """Names of ``param``'s state tensors shaped like it and still in its dtype from before the upcast."""
    state = optimizer.state.get(param) or {}
    return [
        key
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
        and value.dtype == dtype_before != param.dtype
        and value.shape == param.shape
    ]


def release() -> None:
    """At uninstall(): remove the hook unless a parameter is still to be checked."""
    global _hook_handle
    with _lock:
        if not _upcast and _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None


def _held_params(optimizer: torch.optim.Optimizer) -> dict[int, torch.nn.Parameter]:
    groups = tuple((id(group), len(group["params"])) for group in optimizer.param_groups)
    cached = _held.get(optimizer)
    if cached is None or cached[0] != groups:
        cached = (groups, {id(p): p for group in optimizer.param_groups for p in group["params"]})
        _held[optimizer] = cached
    return cached[1]


def _check_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _awaiting_check:
        return  # Note: not removed here: torch is iterating over the hooks
    _check_pending(optimizer)


def _check_pending(optimizer: torch.optim.Optimizer) -> None:
    global _awaiting_check
    with _lock:
        held = _held_params(optimizer)
        stale, checked, late = [], [], False
        for key, (fsdp_param_ref, dtype_before, sharded_before_install) in list(_upcast.items()):
            param = held.get(key)
            fsdp_param = fsdp_param_ref()
            if param is None or fsdp_param is None or fsdp_param.sharded_param is not param:
                continue
            checked.append(key)
            keys = _stale_state(optimizer, param, dtype_before)
            if keys:
                stale.append((_compat.fsdp_param_name(fsdp_param, 0), dtype_before, param.dtype, keys))
                late = late or sharded_before_install
        if not stale:
            for key in checked:
                _upcast.pop(key, None)  # its state is created in its new dtype from now on
            if not _upcast:
                _awaiting_check = False
                _held.clear()
            return
    if late:
        # Note [Installed late] in _fix: the optimizer and its state predate the plugin itself.
        lines = [
            "torch_fsdp_ext was installed after this model was sharded (fully_shard ran before "
            "`import torch_fsdp_ext`), and this optimizer made or loaded its state before the plugin upcast these "
            "parameters to fp32 master weights: that state is in their old dtype (loaded state, and weights loaded "
            "into the model then, were rounded to it):"
        ]
    else:
        lines = [
            "torch_fsdp_ext: this optimizer holds state made before the plugin upcast these parameters to fp32 "
            "master weights; optimizer state made or loaded before the upcast is in their old dtype (loaded state "
            "was rounded to it):"
        ]
    for name, before, after, keys in stale:
        lines.append(f"  {name}: {format_dtype(before)} -> {format_dtype(after)}, state {', '.join(keys)} still "
                     f"{format_dtype(before)}")
    if late:
        lines.append(
            "Fix: move `import torch_fsdp_ext` before fully_shard and before loading the model's weights and the "
            "optimizer's state (or launch with TORCH_FSDP_EXT_AUTOLOAD=1), then resume again. The hand workaround, "
            "model.float() before fully_shard, needs no plugin."
        )
    else:
        lines.append(
            "Fix: install the plugin before building the optimizer, and build it once the model holds its weights "
            "(the plugin then upcasts the model first), then load its state; or call "
            "torch_fsdp_ext.upcast_now(model) before building it. The hand workaround, model.float() before "
            "fully_shard, needs no plugin."
        )
    raise MixedParamDtypeError("\n".join(lines))
