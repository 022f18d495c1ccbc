"""One recomputation of a checkpointed region that the recompute replay follows: where it is in the
region's records, what it entered, and undoing that when it ends early; the recomputation hook's
enter and exit.

Note: exception safety. Checkpoint's early stop ends a recomputation by raising
inside a module's forward, so the matching post-forward never runs. Whatever a
replay entered is undone when the recomputation hook exits (``unwind``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from . import _compat
from ._patching import wraps
from ._recompute_records import RECORDS_ATTR, ForwardContext, FrameRecords
from ._recompute_switch import remove_entry

if TYPE_CHECKING:
    from ._recompute import RecomputeReplay


class Replay(NamedTuple):
    """A replayed pre-forward whose post-forward still has work: exit autocast, cast the output."""

    module: Any
    output_dtype: torch.dtype | None
    autocast_contexts: tuple[Any, ...]  # entered torch.amp.autocast objects, to exit


class RecomputeFrame:
    """A ``_recomputation_hook`` that is active: one recomputation of one region."""

    __slots__ = (
        "hook", "contexts", "cursor", "open", "autocast_on_entry", "replays_every_forward", "outer",
        "device_rng_on_entry", "device_rng_set",
    )

    def __init__(self, hook: Any, records: FrameRecords, outer: RecomputeFrame | None) -> None:
        self.hook = hook
        self.contexts = records.contexts
        # RNG state per device of a root input move when this recomputation began, restored when it ends;
        # None: the region moved no inputs, or its checkpoint does not preserve RNG state.
        self.device_rng_on_entry: dict[torch.device, torch.Tensor] | None = None
        self.device_rng_set: set[torch.device] = set()  # devices whose RNG state the replay set
        self.cursor: dict[Any, int] = {}
        self.open: list[Replay] = []
        # Autocast state per device type when this recomputation began; None: autocast is not replayed.
        self.autocast_on_entry: dict[str, tuple[bool, torch.dtype]] | None = None
        # A plain forward (no root move, autocast off) needs a replay too: a cast or autocast to restore.
        self.replays_every_forward = False
        self.outer = outer  # the recomputation this one runs inside, if any

    def next_context(self, module: Any) -> ForwardContext | None:
        index = self.cursor.get(module, 0)
        contexts = self.contexts.get(module)
        if contexts is None or index >= len(contexts):
            return None
        self.cursor[module] = index + 1
        return contexts[index]


def autocast_off(device_type: str) -> tuple[tuple[str, bool, None], ...]:
    """The forward's autocast when it was off everywhere: disabled, dtype left as it is."""
    return ((device_type, False, None),) if device_type == "cpu" else ((device_type, False, None), ("cpu", False, None))


def autocast_device_types() -> tuple[str, ...]:
    """CPU and this machine's accelerator: the autocast states a recomputation may need restored."""
    accelerator = _compat.accelerator_device_type()
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


def wrap_recompute_enter(fix: RecomputeReplay, original: Callable) -> Callable:
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
        replays_autocast = records.any_autocast or (ambient_autocast_can_leak and _compat.any_autocast_enabled())
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
        if records.input_move_devices and _compat.checkpoint_preserves_rng_state(records.recompute_fn):
            entry.device_rng_on_entry = {d: _compat.device_rng_state(d) for d in records.input_move_devices}
        frames.recompute = entry
        frames.stack.append(entry)
        switch.push()
        return result

    return __enter__


def wrap_exit(fix: RecomputeReplay, original: Callable) -> Callable:
    """``__exit__`` of both checkpoint hooks: a region's forward or a recomputation ends; its frame leaves the stack."""
    frames, lock, frames_anywhere, cells = fix.frames, fix.switch.lock, fix.switch.frames_anywhere, fix.switch.cells

    @wraps(original)
    def __exit__(hook: Any, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        stack = frames.stack if frames_anywhere else None
        if stack:
            entry = stack.pop() if stack[-1].hook is hook else remove_entry(stack, hook)
            if entry is not None:
                with lock:
                    frames_anywhere.pop()
                    if not frames_anywhere:
                        for cell, original_method, _ in cells:
                            cell.cell_contents = original_method
            if type(entry) is RecomputeFrame:
                frames.recompute = entry.outer
                if entry.open:
                    unwind(entry)
                if entry.device_rng_on_entry is not None:
                    # As fork_rng ends checkpoint's recomputation for the devices it knows.
                    for device, rng_state in entry.device_rng_on_entry.items():
                        if rng_state is not None:
                            _compat.set_device_rng_state(device, rng_state)
        return original(hook, exc_type, exc_value, traceback)

    return __exit__
