"""The recompute fix's interface: what this release needs and replays, and installing the wrappers of
torch's checkpoint hooks and FSDP's forward hooks."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

from .. import _compat
from .._compat import _recompute as _compat_recompute
from .._patching import PatchSet
from ._records import attach_records, find_records, wrap_forward_enter, wrap_forward_exit
from ._replay import wrap_post_forward, wrap_pre_forward, wrap_recompute_enter, wrap_recompute_exit
from ._state import ReplayState


class RecomputeReplay(ReplayState):
    """The ``recompute`` fix."""

    name = "recompute"
    summary = "activation-checkpoint recompute under fully_shard replays the forward context"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        super().__init__(internals)
        self.not_covered: list[str] = []

    # -- what this release needs -----------------------------------------------

    def needed(self) -> tuple[bool | None, str]:
        """(None, why) where this torch's checkpoint or FSDP forward state is not what the wrappers read."""
        unlike = _compat_recompute.probe_checkpoint_frames() or _compat_recompute.probe_fsdp_forward_state()
        if unlike is not None:
            return None, f"torch's internals changed ({unlike}); the recompute fix stands aside"
        casts = _compat_recompute.probe_recompute_casts_inputs()
        moves = _compat_recompute.probe_recompute_moves_inputs()
        if casts and moves:
            return False, "this torch replays the input cast and the root input move during recompute"
        if casts:
            return True, "input cast replayed upstream (pytorch#182580); root input move and autocast are not"
        return True, "recompute skips the mixed-precision input cast, output cast and root input move"

    def replays(self) -> dict[str, str]:
        """What is replayed, and by whom, on this torch."""

        def by(upstream: bool) -> str:
            return "upstream" if upstream else "torch_fsdp_ext"

        return {
            "input cast": by(self.upstream_casts_inputs),
            "output cast": by(self.upstream_casts_outputs),
            "root input move": by(self.upstream_moves_inputs),
            "autocast state": "torch_fsdp_ext",
        }

    def wrapped_symbols(self) -> list[str]:
        """FSDP2's own functions, wrapped from ``install()`` on."""
        return _compat.symbol_names(self.internals, ("FSDPState._pre_forward", "FSDPState._post_forward"))

    def outside_fsdp_symbols(self) -> list[str]:
        """The checkpoint hooks every non-reentrant region runs: wrapped from the first FSDP2 state on
        (Note [Armed] in ``_install``)."""
        return _compat.symbol_names(self.internals, ("checkpoint_hook", "recomputation_hook"))

    @property
    def switches_hooks(self) -> bool:
        """The pre/post-forward wrappers are in place only while a checkpoint frame is (``HookSwitch``)."""
        return bool(self.switch.cells)

    # -- install ---------------------------------------------------------------

    def install(self, patches: PatchSet) -> None:
        internals = self.internals
        pre, post = internals.FSDPState.__dict__["_pre_forward"], internals.FSDPState.__dict__["_post_forward"]
        pre_cell, post_cell = _compat_recompute.switchable_method_cell(pre), _compat_recompute.switchable_method_cell(post)
        if pre_cell is not None and post_cell is not None:
            self.switch.add_cell(pre_cell, wrap_pre_forward(self, pre_cell.cell_contents))
            self.switch.add_cell(post_cell, wrap_post_forward(self, post_cell.cell_contents))
            patches.on_restore(self.switch.restore)
        else:
            # Decorated as FSDP decorates the originals: dynamo skips (or traces) both alike.
            for name, wrap in (("_pre_forward", wrap_pre_forward), ("_post_forward", wrap_post_forward)):
                patches.wrap(internals.FSDPState, name, functools.partial(wrap, self), as_decorated=True)
        _warn_if_dynamo_traces(internals.FSDPState.__dict__["_pre_forward"])
        self.active = True
        if not self.switches_hooks:
            self.rebind_existing_hooks(patches)

    def install_outside_fsdp(self, patches: PatchSet) -> None:
        """The checkpoint hooks' wrappers, once a region can hold an FSDP2 module.

        Note: a region whose hooks were made before (its forward began before the first FSDP2 state) has
        no records; its recomputation runs as torch alone runs it, as for a region that began before install().
        """
        internals = self.internals
        # Each wrapper is made for this fix (its first argument) and binds this fix's frames and switch then.
        patches.wrap(internals.checkpoint_hook, "__init__", functools.partial(attach_records, self))
        patches.wrap(internals.recomputation_hook, "__init__", functools.partial(find_records, self))
        patches.wrap(internals.checkpoint_hook, "__enter__", functools.partial(wrap_forward_enter, self))
        patches.wrap(internals.recomputation_hook, "__enter__", functools.partial(wrap_recompute_enter, self))
        patches.wrap(internals.checkpoint_hook, "__exit__", functools.partial(wrap_forward_exit, self))
        patches.wrap(internals.recomputation_hook, "__exit__", functools.partial(wrap_recompute_exit, self))

    def rebind_existing_hooks(self, patches: PatchSet) -> None:
        """Reach modules sharded before ``install()``.

        Note: ``FSDPState.init`` registers ``self._pre_forward`` and
        ``self._post_forward`` as *bound methods*, so patching the class does not
        reach states built earlier. Find those states and re-bind their hooks to
        the patched methods (restored by identity on uninstall). Grouped
        ``fully_shard([a, b])`` registers closures instead; those are reported in
        ``status()`` as not covered.
        """
        state_cls = self.internals.FSDPState
        pre, post = state_cls.__dict__["_pre_forward"], state_cls.__dict__["_post_forward"]
        self.not_covered = []
        for obj in _compat.fsdp_states():
            slots = _compat_recompute.forward_hook_slots(obj)
            if slots is None:
                names = ", ".join(type(m).__name__ for m in getattr(obj, "_modules", ()))
                self.not_covered.append(f"grouped fully_shard([{names}]) sharded before install()")
                continue
            for hooks, hook_id, kind in slots:
                method = pre if kind == "pre" else post
                if hooks[hook_id].__func__ is not method:
                    patches.rebind_hook(hooks, hook_id, method.__get__(obj))


_warned_traced = False


def _warn_if_dynamo_traces(wrapper: Callable) -> None:
    """Warn once when dynamo traces FSDP's hooks, and with them our wrappers (traceable FSDP2, <= 2.11)."""
    global _warned_traced
    decorated = _compat.dynamo_decorator(wrapper)
    if _warned_traced or decorated is None or not _compat.dynamo_decorator_reads_skip_fsdp_hooks(decorated[0]):
        return
    if not _compat.skip_fsdp_hooks():
        _warned_traced = True
        warnings.warn(
            "torch_fsdp_ext: torch._dynamo.config.skip_fsdp_hooks is False (traceable FSDP2), so dynamo traces "
            "FSDP's forward hooks and the plugin's wrappers of them. Results are unchanged, but expect graph "
            "breaks in those hooks that FSDP alone does not have. Set skip_fsdp_hooks=True (the default) to "
            "compile FSDP modules with the plugin at no cost.",
            RuntimeWarning,
            stacklevel=4,
        )
