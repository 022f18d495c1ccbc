"""Rank consistency: the ranks of each FSDP2 param group agree on its dtype layout and on the fixes installed.

The dtype fix decides from dtypes and ``requires_grad`` flags only, so ranks that
built the same model decide alike. Ranks that built different dtypes would
all-gather buffers of different dtypes: a hang or corrupt data. So the ranks of
each group compare a description of the group's layout once, and each rank fails
with an error naming the parameters that differ. The description also lists the
fixes installed on the rank: ranks that installed different fixes would train
differently (a fix that stood aside on one rank only), so they fail alike, with one
error naming the fix and the ranks.

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

Note: how the ranks compare. Through the process group's c10d store, not with a
collective. A rank that runs without the plugin (``TORCH_FSDP_EXT_DISABLE=1`` on
one rank) never takes part: with a collective, the other ranks' plugin all-gather
would be paired with FSDP's own all-gather on that rank and abort the process
(gloo: ``op.preamble.length <= op.nbytes``) or hang. With the store, the ranks
that run the plugin time out after the process group's timeout (what FSDP's own
first collective would wait) with an error naming the ranks that did not answer;
the others see what plain torch does when a peer stops.

Note: what the store sees. The ranks agree when they all hold the same digest of
their layouts, so each rank counts its digest (``add``) and the rank that
completes the count posts the verdict: a fixed number of calls and bytes per rank,
whatever the world size and the model (Note [Rank check protocol]). Only when the
digests differ do the ranks post and read their whole layouts, so that every rank
can name the parameters, dtypes and ranks that differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import types
import weakref
from typing import Any, Callable

import torch.distributed as dist

from . import _compat
from ._patching import PatchSet, wraps

# Note [Rank check protocol]. Keys live under the process group's own store,
# below ``{_KEY_PREFIX}/{elastic attempt}/w{world size}/``:
#   ``round``        one counter per process group, the only key that stays: every rank
#                    adds 1 per comparison; comparison k holds the values k*world+1 ..
#                    (k+1)*world, because no rank starts comparison k+1 before all
#                    ranks added for k. So the ranks agree on k without a local count,
#                    and a new group object, or a group re-created under the same name
#                    on the same store, continues after its predecessor's comparisons.
#   ``r{k}/d/{digest}``  how many ranks hold this layout digest
#   ``r{k}/present``     the ranks that arrived (appended), read only to name the missing
#   ``r{k}/count``       ranks that counted their digest (1..world), then ranks done (..2*world)
#   ``r{k}/verdict``     set by the rank that completes the count: agree or differ
#   ``r{k}/layout/{rank}`` only when the digests differ: each rank's whole layout
# The rank that completes ``count`` to 2*world deletes the comparison's keys. The
# elastic attempt (run id and restart count, the same on every rank of an attempt)
# keeps a restarted job from counting with keys its failed attempt left mid-comparison.
#
# After a timeout the round counter no longer says which comparison a rank is in: the
# rank that gave up has counted, the missing one has not, and a rank that caught the
# error and compares again would count into the same comparison and could agree with
# its own earlier digest. So a rank that times out sets the verdict to ``abandoned``
# (``compare_set``: a verdict that arrived meanwhile wins), and the process group's
# ``abandoned`` key to the same, and deletes the round's other keys. Every comparison
# reads that key first: once it is set, every rank that compares on the process group
# (the one that gave up, a late one, any later comparison) raises at once, naming the
# rank that gave up. Only ``round``, ``abandoned`` and the abandoned verdict stay.
_KEY_PREFIX = "torch_fsdp_ext/rank_check"
_AGREE, _DIFFER, _ABANDONED = "agree", "differ", "abandoned"


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
        # The names of the fixes installed in this process, read at each comparison (set by ``_install``).
        self.installed_fixes: Callable[[], tuple[str, ...]] = tuple

    def install(self, patches: PatchSet) -> None:
        patches.wrap(self.internals.FSDPState, "_lazy_init", self._wrap_lazy_init)
        patches.on_restore(self._uninstalled)
        self._installed = True

    def settle(self, state: Any, original: Callable) -> None:
        """Let ``state`` call torch's ``_lazy_init`` directly: it has nothing left to compare."""
        with self._settled_lock:
            if self._installed:  # not a wrapper call that began before uninstall()
                self._torch_lazy_init = original
                # An instance attribute, set as FSDP sets its own (state.__dict__ would cost
                # every later attribute access on the state: _compat.param_groups_of).
                state._lazy_init = types.MethodType(original, state)
                self._settled.add(state)

    def unsettle(self) -> None:
        """Send every state's ``_lazy_init`` through the wrapper again."""
        with self._settled_lock:
            for state in list(self._settled):
                bound = getattr(state, "_lazy_init", None)
                if isinstance(bound, types.MethodType) and bound.__func__ is self._torch_lazy_init:
                    try:
                        del state._lazy_init
                    except AttributeError:  # torch's own method on the class: nothing was set
                        pass
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
        comparisons = []
        for pg, entries in by_pg.items():
            store = _compat.process_group_store(pg)
            if store is None:
                continue  # no store to compare through (not a c10d process group): nothing to compare with
            comparisons.append(_Comparison.of(pg, store, entries, self.installed_fixes()))
        # Every rank counts all its layouts before it waits for any verdict, so ranks
        # that queued their groups in different orders cannot wait for each other.
        for comparison in comparisons:
            comparison.count()
        for comparison in comparisons:
            comparison.conclude(self.mismatch_error)
        for entries in by_pg.values():
            for group, layout in entries:
                self._compared[group] = layout


def _attempt() -> str:
    """The elastic attempt this process belongs to; the same on every rank of it."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return "-" if restart is None else f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{restart}"


class _Comparison:
    """One comparison of one process group's layouts through its store (Note [Rank check protocol])."""

    def __init__(self, store: Any, me: int, world: int, payload: str, names: str, timeout: Any,
                 timeout_source: str, global_rank: Callable[[int], int] = int) -> None:
        self.store, self.me, self.world = store, me, world
        self.payload, self.names = payload, names
        self.timeout, self.timeout_source, self.global_rank = timeout, timeout_source, global_rank
        self.namespace = f"{_KEY_PREFIX}/{_attempt()}/w{world}/"
        self.verdict: str | None = None
        self.digest_key: str | None = None  # set once this rank counted its digest

    @classmethod
    def of(cls, pg: Any, store: Any, entries: list[tuple[Any, tuple]], fixes: tuple[str, ...]) -> _Comparison:
        timeout = _compat.process_group_timeout(pg)
        source = "the process group's timeout"
        if timeout is None:
            timeout, source = store.timeout, "the store's timeout; the process group's could not be read"
        return cls(
            store, dist.get_rank(pg), dist.get_world_size(pg),
            json.dumps([list(fixes), [(group_name(g), layout) for g, layout in entries]]),
            ", ".join(repr(group_name(g)) for g, _ in entries), timeout, source,
            lambda r: dist.get_global_rank(pg, r),
        )

    def count(self) -> None:
        store, world = self.store, self.world
        arrival = store.add(self.namespace + "round", 1)
        self.round = (arrival - 1) // world
        self.prefix = f"{self.namespace}r{self.round}/"
        if store.check([self.namespace + _ABANDONED]):  # an earlier comparison was given up: none is trusted
            self.verdict = store.get(self.namespace + _ABANDONED).decode()
            return
        self.digest_key = self.prefix + "d/" + _digest(self.payload)
        store.add(self.digest_key, 1)
        store.append(self.prefix + "present", f"{self.me},")
        if store.add(self.prefix + "count", 1) == world:  # every rank's digest is counted
            self.verdict = self._set_verdict(_AGREE if store.add(self.digest_key, 0) == world else _DIFFER)

    def _set_verdict(self, verdict: str) -> str:
        """Set the verdict unless one is set already; the verdict that holds."""
        return self.store.compare_set(self.prefix + "verdict", "", verdict).decode()

    def _abandon(self, reason: str) -> str:
        """Mark this comparison and the process group's abandoned, unless a verdict came first; the verdict."""
        verdict = self._set_verdict(f"{_ABANDONED}:{self.global_rank(self.me)}:{reason}")
        if verdict.startswith(_ABANDONED):
            self._abandon_process_group(verdict)
        return verdict

    def _abandon_process_group(self, verdict: str) -> None:
        self.store.compare_set(self.namespace + _ABANDONED, "", verdict)

    def conclude(self, mismatch_error: type[Exception]) -> None:
        store = self.store
        if self.verdict is None:
            self.verdict = self._wait_for_verdict()
        if self.verdict.startswith(_ABANDONED):
            if self.digest_key is not None:  # counted before it saw the verdict
                self._delete([self.digest_key, self.prefix + "present", self.prefix + "count"])
            raise self._abandoned_error(self.verdict)
        if self.verdict == _AGREE:
            self._finish([self.digest_key])
            return
        # The digests differ: every rank reads every layout, to say on every rank what differs.
        layout_keys = [f"{self.prefix}layout/{r}" for r in range(self.world)]
        store.set(layout_keys[self.me], self.payload)
        others = [r for r in range(self.world) if r != self.me]
        self._wait([layout_keys[r] for r in others], lambda: [r for r in others if not store.check([layout_keys[r]])])
        payloads = {r: store.get(layout_keys[r]).decode() for r in others}
        payloads[self.me] = self.payload
        digests = {self.prefix + "d/" + _digest(payload) for payload in payloads.values()}
        self._finish([*digests, *layout_keys])
        ranks = [self.global_rank(r) for r in range(self.world)]
        raise mismatch_error(_describe(ranks, [json.loads(payloads[r]) for r in range(self.world)]))

    def _wait_for_verdict(self) -> str:
        try:
            self.store.wait([self.prefix + "verdict"], self.timeout)
        except Exception:  # noqa: BLE001 - each store type raises its own timeout error
            pass
        else:
            return self.store.get(self.prefix + "verdict").decode()
        absent = self._missing_from_present()
        verdict = self._abandon(f"its timeout of {self.timeout.total_seconds():g} s")
        if not verdict.startswith(_ABANDONED):
            return verdict  # the last rank came just in time
        self._delete([self.digest_key, self.prefix + "present", self.prefix + "count"])
        raise self._timeout_error(absent)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self.store.delete_key(key)

    def _timeout_error(self, absent: list[int]) -> RankCheckTimeoutError:
        missing = ", ".join(str(self.global_rank(r)) for r in absent) or "(none missing: the ranks are out of step)"
        return RankCheckTimeoutError(
            f"torch_fsdp_ext: rank(s) {missing} did not report the parameter dtypes of FSDP2 group(s) "
            f"{self.names} within {self.timeout.total_seconds():g} s ({self.timeout_source}). "
            "Every rank must run the same torch_fsdp_ext installation (none disabled with "
            "TORCH_FSDP_EXT_DISABLE, the same install()/uninstall() calls and dtype_strategy) and change "
            "parameter dtypes alike. No later comparison on this process group is trusted: each fails at once, "
            "on every rank."
        )

    def _abandoned_error(self, verdict: str) -> RankCheckTimeoutError:
        _, rank, reason = verdict.split(":", 2)
        return RankCheckTimeoutError(
            f"torch_fsdp_ext: the ranks cannot compare the parameter dtypes of FSDP2 group(s) {self.names}: rank "
            f"{rank} gave up a comparison on this process group after {reason}, so the ranks' comparisons are out "
            "of step and none is trusted from here. Restart every rank. Usual causes: ranks that reach their first "
            "forward further apart than the process group's timeout, a rank that caught RankCheckTimeoutError and "
            "went on, ranks with different torch_fsdp_ext installations."
        )

    def _wait(self, keys: list[str], missing: Callable[[], list[int]]) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except Exception:  # noqa: BLE001 - each store type raises its own timeout error
            reason = f"its timeout of {self.timeout.total_seconds():g} s, waiting for layouts"
            self._abandon_process_group(f"{_ABANDONED}:{self.global_rank(self.me)}:{reason}")
            raise self._timeout_error(missing()) from None

    def _missing_from_present(self) -> list[int]:
        present = self.store.get(self.prefix + "present").decode() if self.store.check([self.prefix + "present"]) else ""
        arrived = {int(r) for r in present.split(",") if r}
        return [r for r in range(self.world) if r not in arrived]

    def _finish(self, own_keys: list[str]) -> None:
        """The last rank done with the comparison deletes its keys: only ``round`` stays."""
        if self.store.add(self.prefix + "count", 1) == 2 * self.world:
            for key in (*own_keys, self.prefix + "present", self.prefix + "verdict", self.prefix + "count"):
                self.store.delete_key(key)


def _digest(payload: str) -> str:
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _describe(ranks: list[int], per_rank: list[list]) -> str:
    """What differs between the ranks' descriptions (each the fixes installed and a list of ``(group name, layout)``)."""
    fixes = [set(names) for names, _ in per_rank]
    for fix in sorted(set().union(*fixes)):
        without = [rank for rank, names in zip(ranks, fixes) if fix not in names]
        if without:
            with_it = [rank for rank, names in zip(ranks, fixes) if fix in names]
            return (
                f"torch_fsdp_ext: fix {fix!r} is installed on rank(s) {', '.join(map(str, with_it))} and not on rank(s) "
                f"{', '.join(map(str, without))}; every rank must install the same fixes (the same torch_fsdp_ext "
                "import, install()/uninstall() calls and TORCH_FSDP_EXT_DISABLE setting), or the ranks train "
                "differently. torch_fsdp_ext.status() on each rank says why a fix is not installed."
            )
    per_rank = [groups for _, groups in per_rank]
    if len({tuple(name for name, _ in groups) for groups in per_rank}) > 1:
        listing = "; ".join(f"rank {rank}: {[name for name, _ in groups]}" for rank, groups in zip(ranks, per_rank))
        return f"torch_fsdp_ext: ranks disagree on which FSDP2 groups exist: {listing}"
    for index, (name, _) in enumerate(per_rank[0]):
        layouts = [groups[index][1] for groups in per_rank]
        if len({json.dumps(layout) for layout in layouts}) > 1:
            return _describe_disagreement(name, ranks, layouts)
    raise AssertionError("layouts with different digests are equal")


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


def comparisons_made(pg: Any) -> int:
    """How many comparisons the ranks of ``pg`` made through its store in this elastic attempt."""
    store, world = _compat.process_group_store(pg), dist.get_world_size(pg)
    return store.add(f"{_KEY_PREFIX}/{_attempt()}/w{world}/round", 0) // world
