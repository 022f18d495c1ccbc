"""The hook switch of the recompute replay: FSDP's forward hooks switched to the replay's wrappers
only while some thread has an active checkpoint frame."""

from __future__ import annotations

import threading
from typing import Any, Callable

from ._frames import FrameRecords, RecomputeFrame


class HookSwitch:
    """Counts the frames on the stacks of all threads; where it can, puts the wrappers of
    FSDP's pre/post-forward in place only while there is one.

    Note: why switch. FSDP's hooks run for every module forward, most of them
    in no checkpointed region, where the replay has nothing to do. Torch
    decorates ``FSDPState._pre_forward``/``_post_forward`` for dynamo with a
    wrapper that calls the undecorated method through a closure cell; that
    decorated function is what every module's hooks are bound to, including
    grouped ``fully_shard([a, b])`` closures and modules sharded before
    ``install()``. Setting the cell to our wrapper while some thread has a frame,
    and back to torch's method when the last one ends, makes every other forward
    run exactly torch's code, and needs no hook re-bound. Where torch's method has
    no such cell, the wrappers replace the class attributes for as long as the fix
    is installed, and test ``frames_anywhere`` first (one list read).
    """

    def __init__(self) -> None:
        # Note: re-entrant. A region whose forward raised ends when the garbage collector
        # closes its generator, which can happen at any allocation, also inside push or pop
        # on the same thread (a plain Lock deadlocked there: the ranks of a test hung).
        self.lock = threading.RLock()
        # One entry per frame on any thread's stack: append/pop are atomic under the GIL.
        self.frames_anywhere: list[None] = []
        self.cells: list[list] = []  # [cell, torch's method, our wrapper]

    def add_cell(self, cell: Any, wrapper: Callable) -> None:
        self.cells.append([cell, cell.cell_contents, wrapper])

    # Note: a push and a pop run once per checkpointed region, and a Python call costs about
    # as much as their work: the region's forward-enter and exit wrappers inline them; only a
    # recomputation that replays calls this method.
    def push(self) -> None:
        with self.lock:
            self.frames_anywhere.append(None)
            if len(self.frames_anywhere) == 1:
                for cell, _, wrapper in self.cells:
                    cell.cell_contents = wrapper

    def pop(self) -> None:
        with self.lock:
            self.frames_anywhere.pop()
            if not self.frames_anywhere:
                for cell, original, _ in self.cells:
                    cell.cell_contents = original

    def restore(self) -> None:
        # Note: under the lock, and the cells forgotten: a region's enter or exit that passed
        # the fix's ``active`` check on another thread just before uninstall() then finds
        # nothing to switch, instead of putting the wrapper back for a later install() to
        # take as torch's method.
        with self.lock:
            for cell, original, _ in self.cells:
                cell.cell_contents = original
            self.cells.clear()


def remove_entry(stack: list, entry: FrameRecords | RecomputeFrame | None) -> FrameRecords | RecomputeFrame | None:
    """Remove and return ``entry`` from below the top of the stack (a region whose forward ended late)."""
    for i in range(len(stack) - 2, -1, -1):
        if stack[i] is entry:
            return stack.pop(i)
    return None
