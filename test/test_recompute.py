"""Recompute replay: a checkpoint recompute under FSDP2 reproduces the forward bit for bit."""

from __future__ import annotations

import contextlib
import functools
import gc
import unittest
from typing import Callable, Iterator
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing._internal.common_utils import run_tests
from torch.utils.checkpoint import CheckpointError, checkpoint

import torch_fsdp_ext
from torch_fsdp_ext._compat import _recompute as _compat_recompute
from torch_fsdp_ext._recompute import _state as recompute_state
from torch_fsdp_ext._recompute._frames import FrameRecords

from common import HAS_RECOMPUTE_CAST_BUG, FSDPExtTestCase, MixedPrecisionPolicy, error_text, fully_shard, plugin, plugin_specific
from test_recompute_refcount import cyclic_gc_off, live_objects

DIM = 16
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class MLPBlock(nn.Module):
    """Like the seed's module: an elementwise op on the raw input, so its dtype is saved."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, DIM)
        self.dropout = nn.Dropout(dropout)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(self.dropout(F.gelu(self.lin1(F.gelu(x)))))


class KwargsBlock(MLPBlock):
    def forward(self, *, x: torch.Tensor) -> torch.Tensor:  # keyword-only tensor input
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, blocks: int = 3, block_cls: type = MLPBlock) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block_cls() for _ in range(blocks))

    def forward(self, x: torch.Tensor, run_block: Callable = None) -> torch.Tensor:
        for block in self.blocks:
            x = run_block(block, x) if run_block is not None else block(x)
        return x


class ActivationRecorder:
    """Records every leaf module's output in forward and in recomputation (inside backward)."""

    def __init__(self, model: nn.Module) -> None:
        self.forward: dict[str, list[torch.Tensor]] = {}
        self.recomputed: dict[str, list[torch.Tensor]] = {}
        self.handles = [
            module.register_forward_hook(functools.partial(self._record, name))
            for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, nn.Dropout))
        ]

    def _record(self, name: str, module: nn.Module, args, output: torch.Tensor) -> None:
        in_backward = _compat_recompute.current_graph_task_id() != -1
        (self.recomputed if in_backward else self.forward).setdefault(name, []).append(output.detach().clone())

    def assert_recompute_matches(self, test: unittest.TestCase) -> None:
        test.assertTrue(self.recomputed, "nothing was recomputed")
        for name, outputs in self.recomputed.items():
            for output in outputs:
                matches = [
                    f for f in self.forward.get(name, [])
                    if f.dtype == output.dtype and f.device == output.device and f.shape == output.shape
                    and torch.equal(f, output)
                ]
                test.assertTrue(matches, f"{name}: recomputed {output.dtype} activation differs from the forward")


def sharded(model: nn.Module, mp_policy: MixedPrecisionPolicy, inner: bool = True) -> nn.Module:
    if inner and hasattr(model, "blocks"):
        for block in model.blocks:
            fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def non_reentrant(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False)


class RecomputeTestCase(FSDPExtTestCase):
    def run_flavour(self, build: Callable[[bool], nn.Module], step: Callable, *, autocast: bool = False):
        """Loss and grads of ``step`` (checkpointed) and of the same model run without checkpoint."""
        results = {}
        for checkpointed in (False, True):
            torch.manual_seed(0)
            model = build(checkpointed)
            recorder = ActivationRecorder(model)
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(self.rank), requires_grad=True)
            torch.manual_seed(1)  # same dropout masks in both runs
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = step(model, x, checkpointed)
                loss = out.float().pow(2).mean()
            loss.backward()
            grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
            results[checkpointed] = (loss.detach(), grads, x.grad.clone(), recorder)
        (loss, grads, x_grad, _), (ck_loss, ck_grads, ck_x_grad, recorder) = results[False], results[True]
        recorder.assert_recompute_matches(self)
        self.assertEqual(ck_loss.dtype, loss.dtype)
        torch.testing.assert_close(ck_loss, loss, rtol=0, atol=0)
        torch.testing.assert_close(ck_x_grad, x_grad, rtol=0, atol=0)
        for name in grads:
            torch.testing.assert_close(ck_grads[name], grads[name], rtol=0, atol=0, msg=name)
        return ck_loss, ck_grads

    def check_flavour(self, build, step, *, autocast: bool = False, fails_without_plugin: bool = True):
        """With the plugin: correct. Without it: fails on a torch with the bug, identical on one without."""
        with plugin(True):
            fixed = self.run_flavour(build, step, autocast=autocast)
        with plugin(False):
            if HAS_RECOMPUTE_CAST_BUG and fails_without_plugin:
                with self.assertRaises((CheckpointError, RuntimeError)):
                    self.run_flavour(build, step, autocast=autocast)
            else:
                plain = self.run_flavour(build, step, autocast=autocast)
                torch.testing.assert_close(plain, fixed, rtol=0, atol=0)


@contextlib.contextmanager
def plugin_with_accelerator() -> Iterator[None]:
    """The plugin installed as on a machine with an accelerator, where its regions keep records.

    Note: the tests that use it emulate on CPU what only an accelerator gives (an autocast that
    checkpoint does not restore); without an accelerator, on a torch that casts in recompute by
    itself, the plugin keeps no records at all (``RecomputeReplay.records_regions``).
    """
    with mock.patch.object(recompute_state, "accelerator_available", lambda: True), plugin(True):
        yield


def checkpoint_whole(model, x, checkpointed, **kwargs):
    return checkpoint(model, x, use_reentrant=False, **kwargs) if checkpointed else model(x)


def checkpoint_blocks(model, x, checkpointed):
    return model(x, run_block=non_reentrant if checkpointed else None)


class TestSeedFlavour(RecomputeTestCase):
    @unittest.skipUnless(HAS_RECOMPUTE_CAST_BUG, "this torch casts inputs during recompute")
    def test_checkpoint_error_reproduces_without_plugin(self):
        with plugin(False):
            model = sharded(MLPBlock(), BF16)
            x = torch.randn(4, DIM, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = checkpoint(model, x, use_reentrant=False)
            with self.assertRaises(CheckpointError) as caught:
                out.float().sum().backward()
        self.assertExpectedInline(
            error_text(caught.exception),
            """torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the forward pass.""",
        )

    def test_1_checkpoint_fsdp_module(self):
        self.check_flavour(lambda _: sharded(MLPBlock(), BF16), checkpoint_whole)

    def test_1_checkpoint_fsdp_module_under_autocast(self):
        self.check_flavour(lambda _: sharded(MLPBlock(), BF16), checkpoint_whole, autocast=True)

    def test_2_kwargs_only_tensor_inputs(self):
        def step(model, x, checkpointed):
            return checkpoint(model, x=x, use_reentrant=False) if checkpointed else model(x=x)

        self.check_flavour(lambda _: sharded(KwargsBlock(), BF16), step)

    def test_3_per_block_checkpoint_nested_fsdp(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(Net(), policy), checkpoint_blocks)

    def test_3_per_block_checkpoint_without_early_stop(self):
        from torch.utils.checkpoint import set_checkpoint_early_stop

        def step(model, x, checkpointed):
            with set_checkpoint_early_stop(False):
                return checkpoint_blocks(model, x, checkpointed)

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(Net(), policy), step)


class TestWrapperFlavours(RecomputeTestCase):
    def test_4_checkpoint_wrapper_before_fully_shard(self):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        def build(wrap: bool):
            model = Net()
            if wrap:
                for i, block in enumerate(model.blocks):
                    model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            return sharded(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))

        # The wrapper decides whether to checkpoint, so the baseline is built without it. The checkpoint
        # region sits inside the FSDP unit (FSDP's hooks run outside it), so upstream works here too.
        self.check_flavour(build, self._wrapped_step, fails_without_plugin=False)

    def test_4_composable_checkpoint(self):
        from torch.distributed._composable import checkpoint as composable_checkpoint

        def build(wrap: bool):
            model = Net()
            if wrap:
                for block in model.blocks:
                    composable_checkpoint(block)
            return sharded(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))

        self.check_flavour(build, self._wrapped_step, fails_without_plugin=False)

    def _wrapped_step(self, model, x, checkpointed):
        return model(x)

    def test_5_selective_activation_checkpoint(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])

        def step(model, x, checkpointed):
            return checkpoint_whole(model, x, checkpointed, context_fn=context_fn)

        self.check_flavour(lambda _: sharded(MLPBlock(), BF16), step)

    def test_6_reentrant_checkpoint_keeps_working(self):
        def step(model, x, checkpointed):
            run = functools.partial(checkpoint, use_reentrant=True)
            return model(x, run_block=run if checkpointed else None)

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(Net(), policy), step, fails_without_plugin=False)


class TestAccumulationAndSharing(RecomputeTestCase):
    def test_7_gradient_accumulation_two_forwards_one_backward(self):
        def step(model, x, checkpointed):
            return checkpoint_blocks(model, x, checkpointed) + checkpoint_blocks(model, 2 * x, checkpointed)

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(Net(), policy), step)

    def test_7_module_called_twice_in_one_region(self):
        def twice(block, x):
            return block(block(x))

        def step(model, x, checkpointed):
            block = model.blocks[0]
            return checkpoint(twice, block, x, use_reentrant=False) if checkpointed else twice(block, x)

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(Net(blocks=1), policy), step)


class TestMixedPrecisionVariants(RecomputeTestCase):
    def test_8_fp16_param_dtype(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(MLPBlock(), policy), checkpoint_whole)

    def test_8_output_dtype(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        self.check_flavour(lambda _: sharded(MLPBlock(), policy), checkpoint_whole)

    def test_8_cast_forward_inputs_false(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
        # Nothing to replay: FSDP did not cast in forward either, so behaviour matches upstream.
        self.check_flavour(lambda _: sharded(MLPBlock(), policy), checkpoint_whole, autocast=True, fails_without_plugin=False)


@plugin_specific
class TestReplayMechanics(RecomputeTestCase):
    WORLD_SIZE = 1

    def test_input_cast_is_not_applied_twice_where_upstream_casts(self):
        calls = []
        original = _compat_recompute.cast_floating_tensors

        def counting(dtype, value):
            calls.append(dtype)
            return original(dtype, value)

        _compat_recompute.cast_floating_tensors = counting
        try:
            with plugin(True):
                self.run_flavour(lambda _: sharded(MLPBlock(), BF16), checkpoint_whole)
        finally:
            _compat_recompute.cast_floating_tensors = original
        if HAS_RECOMPUTE_CAST_BUG:
            self.assertEqual(calls, [torch.bfloat16, torch.bfloat16])  # args and kwargs, once
        else:
            self.assertEqual(calls, [])

    def _autocast_only_in_forward(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Forward under autocast that recomputation does not restore (as for CUDA autocast with CPU inputs)."""
        in_recompute = _compat_recompute.current_graph_task_id() != -1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not in_recompute):
            return block(x)

    def test_autocast_state_is_replayed(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.float32)
        with plugin_with_accelerator():
            def step(model, x, checkpointed):
                if checkpointed:
                    return checkpoint(self._autocast_only_in_forward, model, x, use_reentrant=False)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(x)

            self.run_flavour(lambda _: sharded(MLPBlock(), policy), step)
            self.assertFalse(torch.is_autocast_enabled("cpu"))
        with plugin(False), self.assertRaises(CheckpointError):
            self.run_flavour(lambda _: sharded(MLPBlock(), policy), step)

    def test_exception_in_recompute_restores_autocast_and_frames(self):
        class FailsInRecompute(nn.Module):
            def forward(self, x):
                if _compat_recompute.current_graph_task_id() != -1:
                    raise ValueError("boom in recompute")
                return x

        block = MLPBlock()
        block.dropout = FailsInRecompute()  # raises mid-forward, after the FSDP pre-forward replay
        with plugin_with_accelerator():
            fix = torch_fsdp_ext._install._active["recompute"][0]
            model = sharded(block, MixedPrecisionPolicy(param_dtype=torch.float32))
            x = torch.randn(4, DIM, requires_grad=True)
            nesting = torch.autocast_increment_nesting() - 1
            torch.autocast_decrement_nesting()
            out = checkpoint(self._autocast_only_in_forward, model, x, use_reentrant=False)
            with self.assertRaisesRegex(ValueError, "boom in recompute"):
                out.sum().backward()
            self.assertFalse(torch.is_autocast_enabled("cpu"))
            self.assertEqual(torch.autocast_increment_nesting() - 1, nesting)
            torch.autocast_decrement_nesting()
            self.assertEqual(fix.frames.stack, [])
            self.assertIsNone(fix.frames.recompute)

    def test_stash_lives_on_the_frame_and_holds_no_tensors(self):
        with plugin_with_accelerator(), cyclic_gc_off():
            model = sharded(Net(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
            x = torch.randn(4, DIM, requires_grad=True)
            out = checkpoint_blocks(model, x, True)
            frames = [o for o in gc.get_objects() if type(o).__name__ == "_CheckpointFrame"]
            records = [
                r for f in frames for rs in f.__dict__["_torch_fsdp_ext_records"].contexts.values() for r in rs
            ]
            self.assertEqual(len(records), 3)  # one per block forward
            for record in records:
                self.assertFalse(any(isinstance(v, torch.Tensor) for v in record))
            out.sum().backward()
            del out, frames
            self.assertEqual(live_objects("_CheckpointFrame"), 0)  # freed by reference counting

    def test_nothing_is_recorded_or_switched_where_nothing_is_replayed(self):
        """No accelerator, a torch that casts in recompute: regions run torch's code, results as without the plugin."""
        if HAS_RECOMPUTE_CAST_BUG or recompute_state.accelerator_available():
            with plugin(True):
                self.assertTrue(torch_fsdp_ext._install._active["recompute"][0].records_regions)
            self.skipTest("this torch skips the input cast in recompute, or this machine has an accelerator: "
                          "regions keep records")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        hooks_in_regions = []  # per region's forward and recomputation: FSDP's hooks are torch's own

        def checked_block(block, x):
            hooks_in_regions.append(all(cell.cell_contents is torch_method for cell, torch_method, _ in cells))
            return block(x)

        def step(model, x, checkpointed):
            if not checkpointed:
                return model(x)
            out = model(x, run_block=lambda block, x: checkpoint(checked_block, block, x, use_reentrant=False))
            self.assertEqual(live_objects(FrameRecords.__name__), 0)  # three regions wait for their recomputation
            return out

        with plugin(True):
            fix = torch_fsdp_ext._install._active["recompute"][0]
            self.assertFalse(fix.records_regions)
            cells = fix.switch.cells
            fixed = self.run_flavour(lambda _: sharded(Net(), policy), step, autocast=True)
        self.assertEqual(hooks_in_regions, [True] * 6)  # 3 blocks, forward and recomputation
        with plugin(False):
            plain = self.run_flavour(lambda _: sharded(Net(), policy), step, autocast=True)
        torch.testing.assert_close(plain, fixed, rtol=0, atol=0)


# Plugin-specific: the block has dropout, so upstream's replay of the move (PR 2) raises instead (its RNG check).
@plugin_specific
@unittest.skipUnless(torch.cuda.is_available(), "needs CUDA: the root moves CPU inputs only to an accelerator")
class TestRootDeviceMove(RecomputeTestCase):
    WORLD_SIZE = 1

    def test_2_root_with_cpu_inputs(self):
        def step(model, x, checkpointed):
            return checkpoint(model, x.cpu(), use_reentrant=False) if checkpointed else model(x.cpu())

        with plugin(True):
            self.run_flavour(lambda _: sharded(MLPBlock().cuda(), BF16), step)


if __name__ == "__main__":
    run_tests()
