"""The replay of a checkpointed region's forward in its recomputation: the recomputation hook's enter
and exit (undoing what a replay entered when it ends early), and FSDP's pre/post-forward, which
replay a forward's context in a recomputation and record it in a region's forward.

Note: cost. Every FSDP pre-forward inside a checkpointed region runs this,
so the common case is kept to a few attribute reads: autocast state is read
per device only when some autocast is on (one call tells), and a recompute
replays autocast only when its region ran under autocast or, on a machine with
an accelerator, it starts under one. Calls into torch cost microseconds each
between FSDP's and autograd's own work (cold caches), so they are few. A replay
is tracked until post-forward only when post-forward has work. The wrappers
bind the fix's frames and switch as locals when they are made, not per call.

Note: device RNG of a replayed input move. Where checkpoint did not save the
RNG state of the device the root moved its inputs to, the replay sets the state
the forward had at the move and restores, when the recomputation ends, the
state it began with, as checkpoint's ``fork_rng`` does for the devices it knows
(``replay_device_rng``). A checkpoint with ``preserve_rng_state=False``
restores no RNG state anywhere; the replay leaves that device's alone too, as
checkpoint would with the inputs moved beforehand.

Note: exception safety. Checkpoint's early stop ends a recomputation by raising
inside a module's forward, so the matching post-forward never runs. Whatever a
replay entered is undone when the recomputation hook exits (``unwind``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from .._compat import _recompute as _compat_recompute
from .._patching import wraps
from ._frames import PLAIN_FORWARD, RECORDS_ATTR, ForwardContext, RecomputeFrame, Replay
from ._records import capture_autocast, record_input_move
from ._state import ReplayState
from ._switch import remove_entry


def autocast_off(device_type: str) -> tuple[tuple[str, bool, None], ...]:
    """The forward's autocast when it was off everywhere: disabled, dtype left as it is."""
    return ((device_type, False, None),) if device_type == "cpu" else ((device_type, False, None), ("cpu", False, None))


def autocast_device_types() -> tuple[str, ...]:
    """CPU and this machine's accelerator: the autocast states a recomputation may need restored."""
    accelerator = _compat_recompute.accelerator_device_type()
    return ("cpu", accelerator) if accelerator is not None else ("cpu",)


def unwind(entry: RecomputeFrame) -> None:
    """Undo replays whose post-forward never ran (early stop or an exception).

    Exiting the autocast objects keeps autocast's nesting count (and its cast
    cache) balanced; the snapshot then restores the enabled/dtype state the
    recomputation started with, which torch's own autocast contexts inside the
    recomputation already restored before we got here.
    """
    touched = set()
    while entry.open:
        replay = entry.open.pop()
        for autocast in reversed(replay.autocast_contexts):
            autocast.__exit__(None, None, None)
            touched.add(autocast.device)
    for device_type in touched:
        enabled, dtype = entry.autocast_on_entry.get(device_type, (False, torch.get_autocast_dtype(device_type)))
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)


# -- the recomputation hook ------------------------------------------------------


def wrap_recompute_enter(fix: ReplayState, original: Callable) -> Callable:
    """``_recomputation_hook.__enter__``: a recomputation starts; it goes on the frame stack where it replays."""
    frames, switch = fix.frames, fix.switch
    device_types = autocast_device_types()
    # Checkpoint restores the forward's CPU autocast itself, so an autocast the backward runs
    # under can only leak into a recomputation through an accelerator's device type.
    ambient_autocast_can_leak = len(device_types) > 1
    replays_casts = not (fix.upstream_casts_inputs and fix.upstream_casts_outputs)

    @wraps(original)
    def __enter__(hook: Any) -> Any:
        result = original(hook)
        records = getattr(hook, RECORDS_ATTR, None)  # set by find_records
        # No record: no FSDP module ran forward in this region (nor in checkpoints nested in it), so
        # none runs in its recomputation either; e.g. checkpoint_wrapper applied inside an FSDP unit.
        if records is None or not records.contexts or not fix.active:
            return result
        replays_autocast = records.any_autocast or (ambient_autocast_can_leak and _compat_recompute.any_autocast_enabled())
        # Note: nothing to replay (plain forwards, casts done by torch, no autocast to restore) and no
        # region around this one to record into: the recomputation is left to torch alone, so that the
        # FSDP hooks inside it take their fast path.
        if not (replays_casts or replays_autocast or records.any_replay or frames.stack):
            return result
        entry = RecomputeFrame(hook, records, frames.recompute)
        if replays_autocast:
            entry.autocast_on_entry = {
                d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in device_types
            }
        entry.replays_every_forward = entry.autocast_on_entry is not None or replays_casts
        if records.input_move_devices and _compat_recompute.checkpoint_preserves_rng_state(records.recompute_fn):
            entry.device_rng_on_entry = {d: _compat_recompute.device_rng_state(d) for d in records.input_move_devices}
        frames.recompute = entry
        frames.stack.append(entry)
        switch.push()
        return result

    return __enter__


def wrap_recompute_exit(fix: ReplayState, original: Callable) -> Callable:
    """``_recomputation_hook.__exit__``: a recomputation ends and leaves the stack; what it replayed is undone."""
    frames, switch = fix.frames, fix.switch

    @wraps(original)
    def __exit__(hook: Any, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        # The innermost recomputation is the one that ends (ActiveFrames).
        entry = frames.recompute if switch.frames_anywhere else None
        if entry is not None and entry.hook is hook:
            stack = frames.stack
            if stack[-1] is entry:
                stack.pop()
            else:  # a region's forward inside it ended late (ActiveFrames)
                remove_entry(stack, entry)
            switch.pop()
            frames.recompute = entry.outer
            if entry.open:
                unwind(entry)
            if entry.device_rng_on_entry is not None:
                # As fork_rng ends checkpoint's recomputation for the devices it knows.
                for device, rng_state in entry.device_rng_on_entry.items():
                    if rng_state is not None:
                        _compat_recompute.set_device_rng_state(device, rng_state)
        return original(hook, exc_type, exc_value, traceback)

    return __exit__


# -- FSDP pre/post-forward -------------------------------------------------------


def wrap_pre_forward(fix: ReplayState, original: Callable) -> Callable:
    """``FSDPState._pre_forward``: replay the forward's context in a recomputation, record it in a region's forward."""
    frames, frames_anywhere = fix.frames, fix.switch.frames_anywhere
    pre_backward = fix.internals.TrainingState.PRE_BACKWARD
    upstream_moves_inputs = fix.upstream_moves_inputs
    input_moving: dict[torch.device, bool] = {}  # device -> _compat_recompute.moves_inputs_to(device), asked once each

    @wraps(original)
    def _pre_forward(state: Any, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not frames_anywhere:
            return original(state, module, args, kwargs)
        stack = frames.stack
        if not stack or not fix.active:
            return original(state, module, args, kwargs)
        recompute = frames.recompute
        # Advance the cursor even when nothing is replayed, to stay paired with the forward.
        context = recompute.next_context(module) if recompute is not None else None
        if context is not None and state._training_state is pre_backward:
            if recompute.replays_every_forward or context is not PLAIN_FORWARD:
                args, kwargs = replay_pre_forward(fix, recompute, state, module, context, args, kwargs)
            args, kwargs = original(state, module, args, kwargs)
        else:
            if context is not None:  # ran in the recomputed region's forward; its own backward has not begun
                replay_root_claim(fix, recompute, state, module, context, (args, kwargs))
            context = capture_autocast(state._device.type) if _compat_recompute.any_autocast_enabled() else PLAIN_FORWARD
            claims_root = state._state_ctx.iter_forward_root is None
            inputs = (args, kwargs) if claims_root else None
            args, kwargs = original(state, module, args, kwargs)
            if claims_root and state._state_ctx.iter_forward_root is state:
                # Every forward of a block called directly is a root's: one dict read, not a call.
                moves = input_moving.get(state._device)
                if moves is None:
                    moves = input_moving[state._device] = _compat_recompute.moves_inputs_to(state._device)
                if moves:
                    context = record_input_move(
                        stack, recompute, context, state._device, inputs, upstream_moves_inputs
                    )
        if stack[-1] is not recompute:
            # Forward frames above the innermost recompute: this region, and checkpoints nested in it.
            for entry in reversed(stack):
                if entry is recompute:
                    break
                records = entry
                contexts = records.contexts.get(module)
                if contexts is None:
                    records.contexts[module] = [context]
                else:
                    contexts.append(context)
                if context is not PLAIN_FORWARD:
                    records.any_replay = True
                    if context.autocast:
                        records.any_autocast = True
        return args, kwargs

    return _pre_forward


def wrap_post_forward(fix: ReplayState, original: Callable) -> Callable:
    """``FSDPState._post_forward``: end the replay of its pre-forward (autocast entered, output cast)."""
    frames, frames_anywhere = fix.frames, fix.switch.frames_anywhere

    @wraps(original)
    def _post_forward(state: Any, module: Any, input: Any, output: Any) -> Any:
        if not frames_anywhere:
            return original(state, module, input, output)
        recompute = frames.recompute
        if recompute is None or not recompute.open or recompute.open[-1].module is not module:
            return original(state, module, input, output)
        replay = recompute.open.pop()
        output = original(state, module, input, output)
        for autocast in reversed(replay.autocast_contexts):
            autocast.__exit__(None, None, None)
        if replay.output_dtype is not None:
            output = _compat_recompute.cast_floating_tensors(replay.output_dtype, output)
        return output

    return _post_forward


def replay_pre_forward(
    fix: ReplayState, recompute: RecomputeFrame, state: Any, module: Any, context: ForwardContext, args: tuple,
    kwargs: dict,
) -> tuple[tuple, dict]:
    """What FSDP's pre-forward skips in a recomputation: the root input move, the input cast, the forward's autocast."""
    policy = state._mp_policy
    if context.moved_to is not None and not fix.upstream_moves_inputs:
        if recompute.device_rng_on_entry is not None:  # else: preserve_rng_state=False, nothing to restore
            replay_device_rng(recompute, module, context)
        args, kwargs = _compat_recompute.move_inputs(args, kwargs, context.moved_to)
    if not fix.upstream_casts_inputs and policy.cast_forward_inputs and policy.param_dtype is not None:
        args = _compat_recompute.cast_floating_tensors(policy.param_dtype, args)
        kwargs = _compat_recompute.cast_floating_tensors(policy.param_dtype, kwargs)
    entered = ()
    if recompute.autocast_on_entry is not None:
        entered = tuple(enter_forward_autocast(
            context.autocast or autocast_off(state._device.type), context.autocast_cache
        ))
    output_dtype = None if fix.upstream_casts_outputs else policy.output_dtype
    if entered or output_dtype is not None:
        recompute.open.append(Replay(module, output_dtype, entered))
    return args, kwargs


def replay_root_claim(
    fix: ReplayState, recompute: RecomputeFrame, state: Any, module: Any, context: ForwardContext, inputs: tuple
) -> None:
    """Make the root claim of a module that FSDP runs as a forward in a recomputation what it was in the forward.

    Note: while a checkpointed root is recomputed, its nested FSDP modules
    are still ``IDLE`` and take FSDP's forward path, where the first of them
    finds no iteration root and claims it: it would move its inputs, which
    its caller passed as the forward did (a tensor kept on CPU would land on
    the device). Where that move would change an input of a module that did
    not move inputs in the forward, the claim is held for the module, which
    skips the move (and the root's stream waits, which FSDP skips for nested
    modules too); its post-forward releases the claim, as the iteration
    root's does. A module that did move them gets the device's RNG state of
    its forward, as in a replay.
    """
    if state._state_ctx.iter_forward_root is not None:
        return
    if context.moved_to is None:
        if _compat_recompute.moves_inputs_to(state._device) and _compat_recompute.has_tensors_off(state._device, inputs):
            state._state_ctx.iter_forward_root = state
    elif recompute.device_rng_on_entry is not None and not fix.upstream_moves_inputs:
        replay_device_rng(recompute, module, context)


def replay_device_rng(recompute: RecomputeFrame, module: Any, context: ForwardContext) -> None:
    """Give ``context.moved_to`` the RNG state it had when the forward moved the inputs there.

    Note: three cases. The state already equals the forward's: checkpoint
    restored it (a positional argument was on the device), or this
    recomputation already set it at an earlier move. It still is what it was
    when the recomputation began: nothing in the region drew from it yet, so
    setting the forward's state makes the rest draw the same numbers (undone
    when the recomputation ends). Otherwise the region drew from the device
    before this move, with a state checkpoint did not save: those numbers
    differ from the forward's and nothing here can make them equal, so raise.
    """
    device, forward_state = context.moved_to, context.device_rng_state
    current = _compat_recompute.device_rng_state(device)
    if current is None or forward_state is None:
        raise RuntimeError(
            f"torch_fsdp_ext: cannot read the RNG state of {device}, so the recomputation of a checkpointed "
            f"region cannot draw the forward's random numbers there after the FSDP root "
            f"{type(module).__name__} moves its inputs. Move the inputs to {device} before calling checkpoint."
        )
    if torch.equal(current, forward_state):
        return
    if device not in recompute.device_rng_set and torch.equal(current, recompute.device_rng_on_entry[device]):
        _compat_recompute.set_device_rng_state(device, forward_state)
        recompute.device_rng_set.add(device)
        return
    raise RuntimeError(
        f"torch_fsdp_ext: a checkpointed region drew random numbers on {device} before the FSDP root "
        f"{type(module).__name__} moved its inputs there. torch.utils.checkpoint saved no RNG state for "
        f"{device} (the region's positional tensor arguments are on CPU), so its recomputation cannot "
        f"draw the same numbers as the forward. Move the inputs to {device} before calling checkpoint."
    )


def enter_forward_autocast(forward_autocast: tuple, cache_enabled: bool | None) -> Iterator[Any]:
    """Enter an autocast for each device type whose state differs from the forward's; yield them."""
    for device_type, enabled, dtype in forward_autocast:
        if torch.is_autocast_enabled(device_type) == enabled and (
            dtype is None or torch.get_autocast_dtype(device_type) == dtype
        ):
            continue
        autocast = torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        autocast.__enter__()
        yield autocast
