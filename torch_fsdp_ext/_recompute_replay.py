"""One recomputation of a checkpointed region that the recompute replay follows: where it is in the
region's records, what it entered, and undoing that when it ends early."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _compat
from ._recompute_records import ForwardContext, FrameRecords


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
