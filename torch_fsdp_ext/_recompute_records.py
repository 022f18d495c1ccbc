"""Records of a checkpointed region's forward: what its FSDP pre-forwards ran under, kept on the
region's ``_CheckpointFrame`` for the recompute replay (``_recompute_replay``), and the checkpoint
hook wrappers that start them.

Note: how the replay is paired with the forward. While a checkpointed region runs
forward, each FSDP pre-forward stashes a small ``ForwardContext`` (no tensors) on
that region's ``_CheckpointFrame``, keyed by module (one FSDP state per module), in call order.
Recomputing a frame runs the same modules in the same order, so a per-recompute
cursor walks the same lists. Records live on the frame and die with it. A frame
can be recomputed more than once (one per backward graph task), hence a cursor
and not a queue that is consumed.

Note: what a record holds. Only what the FSDP state does not tell: whether this
call was the iteration root that moved the inputs (and then the RNG state of the
device it moved them to, a few bytes on the host), and the autocast state. The
input and output casts follow from the state's ``MixedPrecisionPolicy``, fixed
at ``fully_shard`` time, so the replay reads them there, as upstream's own fix
of the input cast does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from . import _compat
from ._patching import wraps
from ._recompute_switch import remove_entry

if TYPE_CHECKING:
    from ._recompute import RecomputeReplay
    from ._recompute_replay import RecomputeFrame


class ForwardContext(NamedTuple):
    """The part of one module forward's context inside a checkpointed region that its FSDP state does not tell."""

    moved_to: torch.device | None  # the iteration root moved inputs here
    # (device_type, enabled, dtype) for the module's device type and CPU; empty: autocast was off everywhere.
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool | None
    # ``moved_to``'s RNG state when the inputs were moved (a few bytes on the host); None without a move.
    device_rng_state: torch.Tensor | None = None


PLAIN_FORWARD = ForwardContext(moved_to=None, autocast=(), autocast_cache=None)  # by far the most common


class FrameRecords:
    """The forward contexts of one checkpointed region, kept on its ``_CheckpointFrame``.

    While the region runs forward, its records are the region's entry on the thread's
    frame stack. Built by ``attach_records`` without an ``__init__`` of its own: a
    Python-level call per region is a measurable part of what checkpointing costs here.

    Note: nothing here refers to the frame or to its hooks. The frame and its
    checkpoint and recomputation hooks refer to the records, and the hooks' pack
    and unpack closures refer to the frame: a reference from the records back to
    either would make a cycle that keeps the frame, its records and the region's
    inputs alive until the cyclic garbage collector runs, where plain torch frees
    them by reference counting when the region's graph goes.
    """

    any_autocast = False  # some module forward in the region ran under autocast
    any_replay = False  # some module forward's context is not PLAIN_FORWARD
    input_move_devices: tuple[torch.device, ...] = ()  # where root input moves in the region went
    contexts: dict[Any, list[ForwardContext]]  # per module, in call order
    # The frame's, which knows the checkpoint's preserve_rng_state; it refers to the region's
    # function and keyword arguments, not to the frame.
    recompute_fn: Callable


RECORDS_ATTR = "_torch_fsdp_ext_records"


def capture_autocast(device_type: str) -> ForwardContext:
    """The autocast state a forward runs under, for its device type and CPU."""
    autocast = ((device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)),)
    if device_type != "cpu":
        autocast += (("cpu", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),)
    return ForwardContext(moved_to=None, autocast=autocast, autocast_cache=torch.is_autocast_cache_enabled())


def attach_records(fix: RecomputeReplay, original: Callable) -> Callable:
    records_regions = fix.records_regions

    @wraps(original)
    def __init__(hook: Any, frame: Any, *args: Any, **kwargs: Any) -> None:
        original(hook, frame, *args, **kwargs)
        if not records_regions:  # nothing to replay on this machine (RecomputeReplay.records_regions)
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


def find_records(fix: RecomputeReplay, original: Callable) -> Callable:
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


def wrap_forward_enter(fix: RecomputeReplay, original: Callable) -> Callable:
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


def wrap_forward_exit(fix: RecomputeReplay, original: Callable) -> Callable:
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
    if not _compat.has_tensors_off(device, inputs):
        return context
    if upstream_moves_inputs or stack[-1] is recompute:  # the latter: recorded in no region
        return context._replace(moved_to=device)
    for entry in reversed(stack):
        if entry is recompute:
            break
        records = entry
        if device not in records.input_move_devices:
            records.input_move_devices += (device,)
    return context._replace(moved_to=device, device_rng_state=_compat.device_rng_state(device))
