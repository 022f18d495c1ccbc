"""Recompute replay: an activation-checkpoint recompute of an FSDP2 module sees the
forward it replaces.

During non-reentrant recomputation FSDP2 is in ``TrainingState.PRE_BACKWARD`` and
``FSDPState._pre_forward`` skips most of what it did in forward: the
mixed-precision input cast (fixed upstream in 2.13, pytorch#182580), the output
cast, and the root's move of inputs onto the FSDP device (still missing). And
``torch.utils.checkpoint`` restores autocast state only for the device type it
infers from the *positional* tensor args (the current accelerator when they are
all on CPU), and RNG state only for the devices of those args: none for the
device FSDP moves CPU inputs to. The recomputed forward then differs from the
original one:

    torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the
    following tensors have different metadata than during the forward pass.

The fix is in four parts: this module wraps torch's hooks and replays a forward's
context; ``_recompute_records`` keeps what each checkpointed region's forward ran
under; ``_recompute_replay`` follows one recomputation; ``_recompute_switch`` keeps
the frames active per thread and switches FSDP's forward hooks to the wrappers
only while there are some.

Note: cost. Every FSDP pre-forward inside a checkpointed region runs this,
so the common case is kept to a few attribute reads: autocast state is read
per device only when some autocast is on (one call tells), and a recompute
replays autocast only when its region ran under autocast or, on a machine with
an accelerator, it starts under one. Calls into torch cost microseconds each
between FSDP's and autograd's own work (cold caches), so they are few. A replay
is tracked until post-forward only when post-forward has work.

Note: device RNG of a replayed input move. Where checkpoint did not save the
RNG state of the device the root moved its inputs to, the replay sets the state
the forward had at the move and restores, when the recomputation ends, the
state it began with, as checkpoint's ``fork_rng`` does for the devices it knows
(``RecomputeReplay.replay_device_rng``). A checkpoint with
``preserve_rng_state=False`` restores no RNG state anywhere; the replay leaves
that device's alone too, as checkpoint would with the inputs moved beforehand.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from . import _compat
from ._patching import PatchSet, wraps
from ._recompute_records import PLAIN_FORWARD, ForwardContext, attach_records, capture_autocast, find_records
from ._recompute_records import wrap_forward_enter
from ._recompute_replay import RecomputeFrame, Replay, autocast_off, wrap_exit, wrap_recompute_enter
from ._recompute_switch import ActiveFrames, HookSwitch


class RecomputeReplay:
    """The ``recompute`` fix."""

    name = "recompute"
    summary = "activation-checkpoint recompute under fully_shard replays the forward context"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False
        self.frames = ActiveFrames()
        self.switch = HookSwitch()
        # What this release already replays by itself (probed once, cached).
        self.upstream_casts_inputs = bool(_compat.probe_recompute_casts_inputs())
        self.upstream_casts_outputs = bool(_compat.probe_recompute_casts_outputs())
        self.upstream_moves_inputs = bool(_compat.probe_recompute_moves_inputs())
        self.not_covered: list[str] = []

    # -- what this release needs -----------------------------------------------

    def needed(self) -> tuple[bool | None, str]:
        """(None, why) where this torch's checkpoint or FSDP forward state is not what the wrappers read."""
        unlike = _compat.probe_checkpoint_frames() or _compat.probe_fsdp_forward_state()
        if unlike is not None:
            return None, f"torch's internals changed ({unlike}); the recompute fix stands aside"
        casts = _compat.probe_recompute_casts_inputs()
        moves = _compat.probe_recompute_moves_inputs()
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
        return _compat.symbol_names(
            self.internals,
            ("FSDPState._pre_forward", "FSDPState._post_forward", "checkpoint_hook", "recomputation_hook"),
        )

    @property
    def switches_hooks(self) -> bool:
        """The pre/post-forward wrappers are in place only while a checkpoint frame is (``HookSwitch``)."""
        return bool(self.switch.cells)

    # -- install ---------------------------------------------------------------

    def install(self, patches: PatchSet) -> None:
        internals = self.internals
        # Each wrapper is made for this fix (its first argument) and binds this fix's frames and switch then.
        exit_wrapper = functools.partial(wrap_exit, self)
        patches.wrap(internals.checkpoint_hook, "__init__", attach_records)
        patches.wrap(internals.recomputation_hook, "__init__", find_records)
        patches.wrap(internals.checkpoint_hook, "__enter__", functools.partial(wrap_forward_enter, self))
        patches.wrap(internals.recomputation_hook, "__enter__", functools.partial(wrap_recompute_enter, self))
        patches.wrap(internals.checkpoint_hook, "__exit__", exit_wrapper)
        patches.wrap(internals.recomputation_hook, "__exit__", exit_wrapper)
        pre, post = internals.FSDPState.__dict__["_pre_forward"], internals.FSDPState.__dict__["_post_forward"]
        pre_cell, post_cell = _compat.switchable_method_cell(pre), _compat.switchable_method_cell(post)
        if pre_cell is not None and post_cell is not None:
            self.switch.add_cell(pre_cell, self._wrap_pre_forward(pre_cell.cell_contents))
            self.switch.add_cell(post_cell, self._wrap_post_forward(post_cell.cell_contents))
            patches.on_restore(self.switch.restore)
        else:
            # Decorated as FSDP decorates the originals: dynamo skips (or traces) both alike.
            patches.wrap(internals.FSDPState, "_pre_forward", self._wrap_pre_forward, as_decorated=True)
            patches.wrap(internals.FSDPState, "_post_forward", self._wrap_post_forward, as_decorated=True)
        _warn_if_dynamo_traces(internals.FSDPState.__dict__["_pre_forward"])
        self.active = True
        if not self.switches_hooks:
            self.rebind_existing_hooks(patches)

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
            slots = _compat.forward_hook_slots(obj)
            if slots is None:
                names = ", ".join(type(m).__name__ for m in getattr(obj, "_modules", ()))
                self.not_covered.append(f"grouped fully_shard([{names}]) sharded before install()")
                continue
            for hooks, hook_id, kind in slots:
                method = pre if kind == "pre" else post
                if hooks[hook_id].__func__ is not method:
                    patches.rebind_hook(hooks, hook_id, method.__get__(obj))

    # -- FSDP pre/post-forward -------------------------------------------------

    def _wrap_pre_forward(self, original: Callable) -> Callable:
        frames, frames_anywhere = self.frames, self.switch.frames_anywhere
        fix = self
        pre_backward = self.internals.TrainingState.PRE_BACKWARD
        input_moving: dict[torch.device, bool] = {}  # device -> _compat.moves_inputs_to(device), asked once each

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
                    args, kwargs = fix.replay_pre_forward(recompute, state, module, context, args, kwargs)
                args, kwargs = original(state, module, args, kwargs)
            else:
                if context is not None:  # ran in the recomputed region's forward; its own backward has not begun
                    fix.replay_root_claim(recompute, state, module, context, (args, kwargs))
                context = capture_autocast(state._device.type) if _compat.any_autocast_enabled() else PLAIN_FORWARD
                claims_root = state._state_ctx.iter_forward_root is None
                inputs = (args, kwargs) if claims_root else None
                args, kwargs = original(state, module, args, kwargs)
                if claims_root and state._state_ctx.iter_forward_root is state:
                    # Every forward of a block called directly is a root's: one dict read, not a call.
                    moves = input_moving.get(state._device)
                    if moves is None:
                        moves = input_moving[state._device] = _compat.moves_inputs_to(state._device)
                    if moves:
                        context = fix.record_input_move(stack, recompute, context, state._device, inputs)
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

    def _wrap_post_forward(self, original: Callable) -> Callable:
        frames, frames_anywhere = self.frames, self.switch.frames_anywhere

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
                output = _compat.cast_floating_tensors(replay.output_dtype, output)
            return output

        return _post_forward

    def record_input_move(
        self, stack: list, recompute: RecomputeFrame | None, context: ForwardContext, device: torch.device,
        inputs: tuple,
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
        if self.upstream_moves_inputs or stack[-1] is recompute:  # the latter: recorded in no region
            return context._replace(moved_to=device)
        for entry in reversed(stack):
            if entry is recompute:
                break
            records = entry
            if device not in records.input_move_devices:
                records.input_move_devices += (device,)
        return context._replace(moved_to=device, device_rng_state=_compat.device_rng_state(device))

    def replay_device_rng(self, recompute: RecomputeFrame, module: Any, context: ForwardContext) -> None:
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
        current = _compat.device_rng_state(device)
        if current is None or forward_state is None:
            raise RuntimeError(
                f"torch_fsdp_ext: cannot read the RNG state of {device}, so the recomputation of a checkpointed "
                f"region cannot draw the forward's random numbers there after the FSDP root "
                f"{type(module).__name__} moves its inputs. Move the inputs to {device} before calling checkpoint."
            )
        if torch.equal(current, forward_state):
            return
        if device not in recompute.device_rng_set and torch.equal(current, recompute.device_rng_on_entry[device]):
            _compat.set_device_rng_state(device, forward_state)
            recompute.device_rng_set.add(device)
            return
        raise RuntimeError(
            f"torch_fsdp_ext: a checkpointed region drew random numbers on {device} before the FSDP root "
            f"{type(module).__name__} moved its inputs there. torch.utils.checkpoint saved no RNG state for "
            f"{device} (the region's positional tensor arguments are on CPU), so its recomputation cannot "
            f"draw the same numbers as the forward. Move the inputs to {device} before calling checkpoint."
        )

    def replay_root_claim(
        self, recompute: RecomputeFrame, state: Any, module: Any, context: ForwardContext, inputs: tuple
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
            if _compat.moves_inputs_to(state._device) and _compat.has_tensors_off(state._device, inputs):
                state._state_ctx.iter_forward_root = state
        elif recompute.device_rng_on_entry is not None and not self.upstream_moves_inputs:
            self.replay_device_rng(recompute, module, context)

    def replay_pre_forward(
        self, recompute: RecomputeFrame, state: Any, module: Any, context: ForwardContext, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        policy = state._mp_policy
        if context.moved_to is not None and not self.upstream_moves_inputs:
            if recompute.device_rng_on_entry is not None:  # else: preserve_rng_state=False, nothing to restore
                self.replay_device_rng(recompute, module, context)
            args, kwargs = _compat.move_inputs(args, kwargs, context.moved_to)
        if not self.upstream_casts_inputs and policy.cast_forward_inputs and policy.param_dtype is not None:
            args = _compat.cast_floating_tensors(policy.param_dtype, args)
            kwargs = _compat.cast_floating_tensors(policy.param_dtype, kwargs)
        entered = ()
        if recompute.autocast_on_entry is not None:
            entered = tuple(self.enter_forward_autocast(
                context.autocast or autocast_off(state._device.type), context.autocast_cache
            ))
        output_dtype = None if self.upstream_casts_outputs else policy.output_dtype
        if entered or output_dtype is not None:
            recompute.open.append(Replay(module, output_dtype, entered))
        return args, kwargs

    def enter_forward_autocast(self, forward_autocast: tuple, cache_enabled: bool | None):
        """Enter an autocast for each device type whose state differs from the forward's; yield them."""
        for device_type, enabled, dtype in forward_autocast:
            if torch.is_autocast_enabled(device_type) == enabled and (
                dtype is None or torch.get_autocast_dtype(device_type) == dtype
            ):
                continue
            autocast = torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            autocast.__enter__()
            yield autocast


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
