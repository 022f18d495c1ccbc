"""What the recompute replay reads of torch: FSDP's forward hooks and state, the root's input move,
checkpoint frames and hooks, device RNG and autocast state."""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable

import torch

from . import TorchInternals, decorated_method_cell, load_internals


# Device types whose root pre-forward moves inputs onto the FSDP device
# (``FSDPState._root_pre_forward``); on CPU nothing is moved.
_INPUT_MOVING_DEVICE_TYPES = frozenset({"cuda", "hpu", "xpu", "mtia"})


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


def current_graph_task_id() -> int:
    return torch._C._current_graph_task_id()


def _any_autocast_enabled_by_device() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", accelerator_device_type() or "cpu"))


# One call that answers "is autocast on for any device type": the hot path of
# every checkpointed FSDP forward asks it instead of reading each device's state.
any_autocast_enabled: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast_enabled_by_device)


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
