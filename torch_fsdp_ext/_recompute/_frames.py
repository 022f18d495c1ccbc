"""What the recompute replay keeps: per checkpointed region, the records of its forward (on its
``_CheckpointFrame``); per recomputation, where it is in them; per thread, the frames active on it.

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

import threading
from typing import Any, Callable, NamedTuple

import torch


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
        self.hook = hook  # tells its exit; held only by the thread's frame stack, so no cycle through torch's objects
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


class ActiveFrames(threading.local):
    """Checkpoint frames active on this thread, innermost last (saved-tensor hooks are per thread).

    Note: ``recompute`` is the innermost entry of ``stack`` that is a
    recomputation, so that the hooks, which run for every FSDP module forward,
    find it without a search. Recomputations are ``with`` blocks inside
    checkpoint's unpack hook, so they end in the reverse order of their start;
    a region's forward can end out of order (its generator is closed late when
    the forward raised), hence a list for ``stack``.
    """

    def __init__(self) -> None:
        self.stack: list[FrameRecords | RecomputeFrame] = []
        self.recompute: RecomputeFrame | None = None
