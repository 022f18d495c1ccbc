"""Rank consistency: the ranks of each FSDP2 param group agree on its dtype layout.

The dtype fix decides from dtypes and ``requires_grad`` flags only, so ranks that
built the same model decide alike. Ranks that built different dtypes would
all-gather buffers of different dtypes: a hang or corrupt data. So the ranks of
each group compare a description of the group's layout once, and each rank fails
with an error naming the parameters that differ.

Note: when the ranks compare. Only where every rank of the group reaches FSDP
itself: the root's first lazy init, i.e. the first forward. FSDP also runs a
group's ``lazy_init`` -> ``_init_mp_dtypes`` from every explicit
``FSDPModule.unshard()``, which a rank may call alone (to look at a full weight
on rank 0, or to prefetch): waiting for the other ranks there would block that
rank until they join. What ``_init_mp_dtypes`` sees is only noted; a group whose
layout differs from the one last compared (a ``.to(bf16)`` after the first
forward, seen by an explicit ``unshard()``) is compared at the next root forward.

Note: cost. FSDP calls ``_lazy_init`` from every module's first pre-forward of
each pass. Once a state is initialized and nothing is left to compare, the
wrapper has nothing to do for it, so it sets torch's own method on that state
(an instance attribute, found before the class's): from then on FSDP calls torch
directly. A layout queued for comparison takes those instance attributes away
again, so the next root forward goes through the wrapper; so does uninstall.

Note: how the ranks compare. Through the process group's c10d store (each rank
sets one key, then waits for the others' keys), not with a collective. A rank
that runs without the plugin (``TORCH_FSDP_EXT_DISABLE=1`` on one rank) never
takes part: with a collective, the other ranks' plugin all-gather would be
paired with FSDP's own all-gather on that rank and abort the process (gloo:
``op.preamble.length <= op.nbytes``) or hang. With the store, the ranks that run
the plugin time out after the store's timeout (the process group's timeout) with
an error naming the ranks that did not answer; the others see what plain torch
does when a peer stops (FSDP's own collective fails or times out).
"""

from __future__ import annotations

import json
import threading
import types
import weakref
from typing import Any, Callable

import torch.distributed as dist

from . import _compat
from ._patching import PatchSet, wraps

_KEY_PREFIX = "torch_fsdp_ext/dtype_layout"

# Note: comparisons made through each process group's store, per process. The
# keys stay in the store, so a comparison's keys must never be reused: the count
# outlives each install() (``installed()`` scopes, uninstall/install) and a
# reload of this module, and every rank counts alike because every rank compares
# at the same root forwards.
_rounds: dict[Any, int] = globals().get("_rounds", {})
_rounds_lock: threading.Lock = globals().get("_rounds_lock") or threading.Lock()


class RankCheckTimeoutError(RuntimeError):
    """Some ranks of a process group never reported their dtype layout."""


def group_name(group: Any) -> str:
    return getattr(group, "_module_fqn", None) or "<root>"


def layout_of(group: Any) -> tuple[tuple[str, str, bool], ...]:
    """What the ranks must agree on: each parameter's FQN, dtype and trainability."""
    return tuple(
        (_compat.fsdp_param_fqn(p) or f"<param {i}>", str(p.sharded_param.dtype), _compat.fsdp_param_is_trainable(p))
        for i, p in enumerate(group.fsdp_params)
    )


class _ThreadState(threading.local):
    """Per thread: FSDP lazy init runs on the thread that runs the forward."""

    def __init__(self) -> None:
        self.in_root_lazy_init = False
        self.pending: dict[Any, tuple] = {}  # group -> layout to compare at the next root forward


class RankConsistency:
    """Compares each group's dtype layout across its ranks, at most once per layout."""

    def __init__(self, internals: _compat.TorchInternals, mismatch_error: type[Exception]) -> None:
        self.internals = internals
        self.mismatch_error = mismatch_error
        self._compared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> layout
        self._thread = _ThreadState()
        # FSDP states that call torch's _lazy_init directly (weakly: the method set on each refers to it).
        self._settled: weakref.WeakSet = weakref.WeakSet()
        self._torch_lazy_init: Callable | None = None
        self._settled_lock = threading.Lock()  # install/uninstall may run on another thread than training
        self._installed = False

    def install(self, patches: PatchSet) -> None:
        patches.wrap(self.internals.FSDPState, "_lazy_init", self._wrap_lazy_init)
        patches.on_restore(self._uninstalled)
        self._installed = True

    def settle(self, state: Any, original: Callable) -> None:
        """Let ``state`` call torch's ``_lazy_init`` directly: it has nothing left to compare."""
        with self._settled_lock:
            if self._installed:  # not a wrapper call that began before uninstall()
                self._torch_lazy_init = original
                state.__dict__["_lazy_init"] = types.MethodType(original, state)
                self._settled.add(state)

    def unsettle(self) -> None:
        """Send every state's ``_lazy_init`` through the wrapper again."""
        with self._settled_lock:
            for state in list(self._settled):
                bound = state.__dict__.get("_lazy_init")
                if isinstance(bound, types.MethodType) and bound.__func__ is self._torch_lazy_init:
                    del state.__dict__["_lazy_init"]
            self._settled.clear()

    def _uninstalled(self) -> None:
        self._installed = False
        self.unsettle()

    def note_layout(self, group: Any) -> None:
        """Called from ``_init_mp_dtypes``: queue the group if its layout was not compared yet."""
        thread = self._thread
        if not thread.in_root_lazy_init and group not in self._compared:
            return  # an unshard() before the first forward: that forward's lazy init compares it
        layout = layout_of(group)
        if self._compared.get(group) != layout:
            thread.pending[group] = layout
            if self._settled:
                self.unsettle()  # the next root forward compares it
        else:
            thread.pending.pop(group, None)

    def _wrap_lazy_init(self, original: Callable) -> Callable:
        ranks = self
        thread = self._thread
        is_root_flag = _compat.is_root_flag

        @wraps(original)
        def _lazy_init(state: Any) -> None:
            # FSDP's first pre-forward of each state in each pass calls this; after the first forward it is a
            # no-op in torch.
            if is_root_flag(state) is not None:
                if thread.pending:
                    ranks.compare_pending()
                else:
                    ranks.settle(state, original)
                return original(state)
            thread.in_root_lazy_init = True
            try:
                original(state)
            except BaseException:
                thread.pending.clear()  # the error is this rank's to report; nothing left to compare
                raise
            finally:
                thread.in_root_lazy_init = False
            ranks.compare_pending()
            ranks.settle(state, original)

        return _lazy_init

    def compare_pending(self) -> None:
        pending, self._thread.pending = self._thread.pending, {}
        by_pg: dict[Any, list[tuple[Any, tuple]]] = {}
        for group, layout in pending.items():
            pg = _compat.group_process_group(group)
            # The fake backend (world-size simulation) moves no data, so there is nothing to compare.
            if pg is None or dist.get_world_size(pg) == 1 or dist.get_backend(pg) == "fake":
                self._compared[group] = layout
                continue
            by_pg.setdefault(pg, []).append((group, layout))
        posted = []
        # Every rank posts all its layouts before it waits for any, so ranks that
        # queued their groups in different orders cannot wait for each other.
        for pg, entries in by_pg.items():
            store = _compat.process_group_store(pg)
            if store is None:
                continue  # no store to compare through (not a c10d process group): nothing to compare with
            with _rounds_lock:
                round_index = _rounds.get(pg, 0)
                _rounds[pg] = round_index + 1
            prefix = f"{_KEY_PREFIX}/{round_index}/"
            mine = json.dumps([(group_name(g), layout) for g, layout in entries])
            store.set(prefix + str(dist.get_rank(pg)), mine)
            posted.append((pg, store, prefix, entries, mine))
        for pg, store, prefix, entries, mine in posted:
            self._compare(pg, store, prefix, entries, mine)
        for entries in by_pg.values():
            for group, layout in entries:
                self._compared[group] = layout

    def _compare(self, pg: Any, store: Any, prefix: str, entries: list, mine: str) -> None:
        me, world = dist.get_rank(pg), dist.get_world_size(pg)
        others = [r for r in range(world) if r != me]
        names = ", ".join(repr(group_name(g)) for g, _ in entries)
        try:
            store.wait([prefix + str(r) for r in others], store.timeout)
        except Exception:  # noqa: BLE001 - each store type raises its own timeout error
            missing = [dist.get_global_rank(pg, r) for r in others if not store.check([prefix + str(r)])]
            raise RankCheckTimeoutError(
                f"torch_fsdp_ext: rank(s) {', '.join(map(str, missing))} did not report the parameter dtypes of "
                f"FSDP2 group(s) {names} within {store.timeout.total_seconds():g} s (the process group's timeout). "
                "Every rank must run the same torch_fsdp_ext installation (none disabled with "
                "TORCH_FSDP_EXT_DISABLE, the same install()/uninstall() calls and dtype_strategy) and change "
                "parameter dtypes alike."
            ) from None
        values = {r: store.get(prefix + str(r)).decode() for r in others}
        values[me] = mine
        if len(set(values.values())) == 1:
            return
        per_rank = [json.loads(values[r]) for r in range(world)]
        ranks = [dist.get_global_rank(pg, r) for r in range(world)]
        if len({tuple(name for name, _ in groups) for groups in per_rank}) > 1:
            listing = "; ".join(f"rank {rank}: {[name for name, _ in groups]}" for rank, groups in zip(ranks, per_rank))
            raise self.mismatch_error(f"torch_fsdp_ext: ranks disagree on which FSDP2 groups exist: {listing}")
        for index, (name, _) in enumerate(per_rank[0]):
            layouts = [groups[index][1] for groups in per_rank]
            if len({json.dumps(layout) for layout in layouts}) > 1:
                raise self.mismatch_error(_describe_disagreement(name, ranks, layouts))


def _describe_disagreement(name: str, ranks: list[int], layouts: list[list]) -> str:
    lines = [
        f"torch_fsdp_ext: ranks disagree on the parameter dtypes of FSDP2 group {name!r}; every rank must "
        "build the model with the same dtypes and requires_grad flags before fully_shard:"
    ]
    if len({len(layout) for layout in layouts}) > 1:
        counts = ", ".join(f"rank {rank}: {len(layout)}" for rank, layout in zip(ranks, layouts))
        lines.append(f"  number of parameters: {counts}")
    for entries in zip(*layouts):
        if len({(dtype, trainable) for _, dtype, trainable in entries}) > 1:
            per_rank = ", ".join(
                f"rank {rank}: {dtype}{'' if trainable else ' (frozen)'}"
                for rank, (_, dtype, trainable) in zip(ranks, entries)
            )
            lines.append(f"  {entries[0][0]}: {per_rank}")
    return "\n".join(lines)
