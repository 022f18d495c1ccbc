"""Records of a checkpointed region's forward: the checkpoint hook's wrappers, which attach a
region's records to its ``_CheckpointFrame`` and put them on the thread's frame stack while its
forward runs, and what a root input move inside a region records.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._compat import _recompute as _compat_recompute
from .._patching import wraps
from ._frames import RECORDS_ATTR, ForwardContext, FrameRecords, RecomputeFrame
from ._state import ReplayState
from ._switch import remove_entry


def capture_autocast(device_type: str) -> ForwardContext:
    """The autocast state a forward runs under, for its device type and CPU."""
    autocast = ((device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)),)
    if device_type != "cpu":
        autocast += (("cpu", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),)
    return ForwardContext(moved_to=None, autocast=autocast, autocast_cache=torch.is_autocast_cache_enabled())


def attach_records(fix: ReplayState, original: Callable) -> Callable:
    records_regions = fix.records_regions

    @wraps(original)
    def __init__(hook: Any, frame: Any, *args: Any, **kwargs: Any) -> None:
        original(hook, frame, *args, **kwargs)
        if not records_regions:  # nothing to replay on this machine (ReplayState.records_regions)
            return
        # Torch gives each frame one checkpoint hook: this is where the frame's records start.
        # setattr, not __dict__: a hook's attributes stay in CPython's inline values (_compat.param_groups_of).
        # Note: never raises. A frame unlike the probed one gets no records: its region runs as torch alone runs it.
        try:
            records = FrameRecords()
            records.contexts, records.recompute_fn = {}, frame.recompute_fn
            setattr(frame, RECORDS_ATTR, records)
            setattr(hook, RECORDS_ATTR, records)
        except Exception:  # noqa: BLE001
            pass

    return __init__


def find_records(fix: ReplayState, original: Callable) -> Callable:
    records_regions = fix.records_regions

    @wraps(original)
    def __init__(hook: Any, target_frame_ref: Any, *args: Any, **kwargs: Any) -> None:
        original(hook, target_frame_ref, *args, **kwargs)
        if not records_regions:  # no frame has records, as attach_records
            return
        try:  # never raises, as attach_records
            setattr(hook, RECORDS_ATTR, getattr(target_frame_ref(), RECORDS_ATTR, None))
        except Exception:  # noqa: BLE001
            pass

    return __init__


def wrap_forward_enter(fix: ReplayState, original: Callable) -> Callable:
    """``_checkpoint_hook.__enter__``: the region's forward starts; its records go on the thread's frame stack."""
    frames, lock, frames_anywhere, cells = fix.frames, fix.switch.lock, fix.switch.frames_anywhere, fix.switch.cells

    @wraps(original)
    def __enter__(hook: Any) -> Any:
        result = original(hook)
        records = getattr(hook, RECORDS_ATTR, None)  # set by attach_records
        if records is not None and fix.active:
            frames.stack.append(records)
            with lock:  # HookSwitch.push
                frames_anywhere.append(None)
                if len(frames_anywhere) == 1:
                    for cell, _, wrapper in cells:
                        cell.cell_contents = wrapper
        return result

    return __enter__


def wrap_forward_exit(fix: ReplayState, original: Callable) -> Callable:
    """``_checkpoint_hook.__exit__``: the region's forward ends; its records leave the thread's frame stack."""
    frames, lock, frames_anywhere, cells = fix.frames, fix.switch.lock, fix.switch.frames_anywhere, fix.switch.cells

    @wraps(original)
    def __exit__(hook: Any, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        stack = frames.stack if frames_anywhere else None
        if stack:
            records = getattr(hook, RECORDS_ATTR, None)
            entry = stack.pop() if stack[-1] is records else remove_entry(stack, records)
            if entry is not None:
                with lock:  # HookSwitch.pop
                    frames_anywhere.pop()
                    if not frames_anywhere:
                        for cell, original_method, _ in cells:
                            cell.cell_contents = original_method
        return original(hook, exc_type, exc_value, traceback)

    return __exit__


def record_input_move(
    stack: list, recompute: RecomputeFrame | None, context: ForwardContext, device: torch.device, inputs: tuple,
    upstream_moves_inputs: bool,
) -> ForwardContext:
    """The context of a forward that moved the iteration's ``inputs`` onto ``device`` inside checkpointed regions.

    A move that changed nothing (inputs already on the device) is not recorded: its replay would not either.

    Note: the replay of this move must also replay ``device``'s RNG state.
    Checkpoint restores RNG state only for the devices of its positional
    tensor arguments; with CPU arguments that FSDP moves it restores none
    for ``device``, and a recomputation would draw other random numbers
    there (other dropout masks) than the forward did.
    """
    if not _compat_recompute.has_tensors_off(device, inputs):
        return context
    if upstream_moves_inputs or stack[-1] is recompute:  # the latter: recorded in no region
        return context._replace(moved_to=device)
    for entry in reversed(stack):
        if entry is recompute:
            break
        records = entry
        if device not in records.input_move_devices:
            records.input_move_devices += (device,)
    return context._replace(moved_to=device, device_rng_state=_compat_recompute.device_rng_state(device))
