"""The scenarios of PR 2's test, on CPU: which forwards and recomputations get their inputs moved.

Note: FSDP2 moves a root's inputs only onto an accelerator (``cuda``, ``hpu``, ``xpu``,
``mtia`` or the PrivateUse1 backend), so on CPU nothing moves and PR 2's own test
(``test_fully_shard_recompute_inputs.py``) skips. Here, after lazy init, each FSDP
state's device reads as ``cuda`` (after lazy init FSDP2 uses it only for that check and
as the move's target), and ``_to_kwargs`` (the move itself, as ``_fsdp_state`` imports
it) returns clones that it remembers instead of moving: a module input that is one of
those clones was moved. The assertions are those of PR 2's test with "on the device"
read as "moved". Where a GPU would fail on a device mismatch (the root computing on a
CPU input), the stand-in model raises ``StandInDeviceMismatch`` instead; a model that
moves its input itself (as the models of the v4 review do) never does.

The device's RNG: each state's device handle (``torch.cuda`` on a CUDA device, whose
``get_rng_state`` FSDP reads) is a ``StandInDeviceHandle`` whose RNG is a
``torch.Generator`` of its own; ``DeviceDropout`` draws its mask from it, as dropout on a
CUDA tensor draws from the CUDA generator. Checkpoint does not know that generator, as
it does not know a CUDA device's when every positional argument is on CPU.

Run by ``check.py`` against the patched FSDP2 copy (all pass on PR 2 v5), and against
PR 2's previous versions, where the review cases of each must fail: ``test_review_case``
1(a)-(c) and flat 2 on v3, ``test_review_v4_case`` and ``test_records_bounded`` on v4.
Against unpatched torch 2.15.0 (``TORCH_FSDP_EXT_DISABLE=1 python -m pytest
tools/upstream/test_recompute_inputs_on_cpu.py``): ``test_checkpoint_with_cpu_inputs``
fails for ``root`` and ``block_run_alone`` (the device mismatch PR 2 fixes) and for the two
dropout layouts (no warning); every review case and ``test_records_bounded`` pass.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from unittest import mock

import torch
import torch.nn as nn
import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "test"))
from common import FSDPExtTestCase, full_grads, fully_shard  # noqa: E402

# What PR 2 v5 warns when it does not replay a move (the recomputation then runs as on unpatched torch)
NO_REPLAY_WARNING = r"FSDP does not move \w*Model's inputs to cuda in activation checkpointing recomputation"


class StandInDeviceMismatch(RuntimeError):
    """What a GPU raises when the root computes on a CPU input with its parameters on the device."""


class MovedTensors:
    """Wraps FSDP's ``_to_kwargs`` so that every tensor it moves becomes a remembered clone."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return any(tensor is moved for moved in self.tensors)

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` moved to the device: a remembered clone, or ``tensor`` if it already is one."""
        if tensor in self:
            return tensor
        moved = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        self.tensors.append(moved)
        return moved

    def to_kwargs(self, args, kwargs, device, use_side_stream):
        def move(value):
            return self.on_device(value) if isinstance(value, torch.Tensor) else value

        return (tuple(move(a) for a in args),), ({k: move(v) for k, v in kwargs.items()},)


class StandInDeviceHandle:
    """FSDP's device handle (streams etc. from the real one) with a device RNG of its own."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.generator = torch.Generator().manual_seed(1234)
        self.rng_state_reads = 0

    def get_rng_state(self, device=None) -> torch.Tensor:
        self.rng_state_reads += 1
        return self.generator.get_state()

    def __getattr__(self, name: str):
        return getattr(self.handle, name)


class StandInHandleWithoutRNGState(StandInDeviceHandle):
    """A device handle that cannot read its device's RNG state."""

    def __getattribute__(self, name: str):
        if name == "get_rng_state":
            raise AttributeError(name)
        return super().__getattribute__(name)

    def __getattr__(self, name: str):
        if name == "get_rng_state":
            raise AttributeError(name)
        return super().__getattr__(name)


class DeviceDropout(nn.Module):
    def __init__(self, device_handle: StandInDeviceHandle) -> None:
        super().__init__()
        self.device_handle = device_handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=self.device_handle.generator) >= 0.5) * 2


class Block(nn.Module):
    def __init__(self, dim: int, moved: MovedTensors) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.moved = moved
        self.host_input_moved: list[bool] = []  # one entry per forward or recomputation
        self.dropout = nn.Identity()

    def forward(self, x: torch.Tensor, host_scale: torch.Tensor) -> torch.Tensor:
        self.host_input_moved.append(host_scale in self.moved)
        return self.dropout(torch.relu(self.lin(x))) * host_scale


class Model(nn.Module):
    def __init__(self, dim: int, moved: MovedTensors) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim, moved) for _ in range(2)])
        self.moved = moved
        self.input_moved: list[bool] = []
        self.checkpoint_blocks = False
        self.dropout = nn.Identity()
        self.root_ops = True  # False: hands its input straight to block 0
        self.moves_input_itself = False  # as the models of the v4 review do
        self.check_device = False  # raise where a GPU would (set once the stand-in device is in place)
        self.device_dropout: nn.Module = nn.Identity()  # applied when a forward asks for it

    def forward(
        self, x: torch.Tensor, lengths: torch.Tensor | None = None, device_dropout: bool = False
    ) -> torch.Tensor:
        self.input_moved.append(x in self.moved)
        if self.moves_input_itself:
            x = self.moved.on_device(x)
        if self.root_ops:
            if self.check_device and x not in self.moved:
                raise StandInDeviceMismatch("Expected all tensors to be on the same device (stand-in)")
            x = self.dropout(self.in_proj(x))
        if lengths is not None:  # a 0-d CPU tensor: a GPU takes it on CPU as a scalar
            x = x * lengths
        if device_dropout:
            x = self.device_dropout(x)
        host_scale = torch.full((1,), 0.5)
        for block in self.blocks:
            x = checkpoint(block, x, host_scale, use_reentrant=False) if self.checkpoint_blocks else block(x, host_scale)
        return x


def record_count(model: nn.Module) -> int:
    """The root input moves FSDP holds for ``model``'s states (0 on unpatched torch)."""
    moves = getattr(fully_shard.state(model)._state_ctx, "root_input_moves", ())
    return sum(len(region) for region in moves.values()) if hasattr(moves, "values") else len(moves)


class TestRecomputeInputsOnCPU(FSDPExtTestCase):
    WORLD_SIZE = 2

    @contextlib.contextmanager
    def stand_in_device(self, model: Model, moved: MovedTensors, handle_type=StandInDeviceHandle):
        """From here on the FSDP states of ``model`` read as on ``cuda`` and move through ``moved``."""
        states = {fully_shard.state(m) for m in model.modules() if isinstance(m, FSDPModule)}
        device_handle = handle_type(fully_shard.state(model)._device_handle)
        with mock.patch.multiple(fsdp_state, _to_kwargs=moved.to_kwargs), contextlib.ExitStack() as stack:
            for state in states:
                stack.enter_context(mock.patch.object(state, "_device", torch.device("cuda")))
                stack.enter_context(mock.patch.object(state, "_device_handle", device_handle))
            model.check_device = True
            yield device_handle

    def build(self, shard_blocks: bool = True) -> tuple[Model, Model, MovedTensors, torch.Tensor]:
        moved = MovedTensors()
        torch.manual_seed(42)
        model = Model(16, moved)
        ref_model = copy.deepcopy(model)
        if shard_blocks:
            for block in model.blocks:
                fully_shard(block)
        fully_shard(model)
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((4, 16))
        model(inp).sum().backward()  # lazy init from the root
        model.zero_grad(set_to_none=True)
        model.input_moved.clear()
        return model, ref_model, moved, inp

    def assert_grads_equal_reference(self, model: nn.Module, ref_model: nn.Module) -> None:
        for param in ref_model.parameters():
            if param.grad is not None:
                torch.distributed.all_reduce(param.grad)
                param.grad.div_(self.world_size)
        ref_grads = {name: p.grad for name, p in ref_model.named_parameters() if p.grad is not None}
        self.assertEqual(full_grads(model), ref_grads)

    @parametrize(
        "checkpointed",
        ["root", "root_with_device_dropout", "bare_root_with_device_dropout", "nested_blocks", "block_run_alone"],
    )
    def test_checkpoint_with_cpu_inputs(self, checkpointed: str) -> None:
        model, ref_model, moved, inp = self.build()
        host_scale = torch.full((1,), 0.5)
        with self.stand_in_device(model, moved) as device_handle:
            for block in model.blocks:
                block.host_input_moved.clear()
            if checkpointed == "root_with_device_dropout":
                # The region draws device random numbers, which checkpoint does not restore (its
                # argument is on CPU): no replay, and the recomputation fails on the device
                # mismatch, as on unpatched torch
                model.dropout = DeviceDropout(device_handle)
                loss = checkpoint(model, inp, use_reentrant=False).sum()
                with self.assertWarnsRegex(UserWarning, NO_REPLAY_WARNING), self.assertRaises(StandInDeviceMismatch):
                    loss.backward()
                return
            if checkpointed == "bare_root_with_device_dropout":
                # The root hands its input straight to block 0, which, still idle in the
                # recomputation, claims the iteration root and moves it (unpatched torch too): it
                # runs, with other masks than the forward's. No replay; a warning says why.
                model.root_ops = False
                for block in model.blocks:
                    block.dropout = DeviceDropout(device_handle)
                loss = checkpoint(model, inp, use_reentrant=False).sum()
                with self.assertWarnsRegex(UserWarning, NO_REPLAY_WARNING):
                    loss.backward()
                self.assertEqual(model.input_moved, [True, False])  # forward, recomputation
                self.assertEqual(record_count(model), 0)  # block 0's move in the recomputation included
                return
            if checkpointed == "root":
                checkpoint(model, inp, use_reentrant=False).sum().backward()
                ref_model(inp).sum().backward()
                self.assertEqual(model.input_moved, [True, True])  # forward and recomputation
            elif checkpointed == "nested_blocks":
                model.checkpoint_blocks = True
                model(inp).sum().backward()
                ref_model(inp).sum().backward()
                self.assertEqual(model.input_moved, [True])
                for block in model.blocks:
                    self.assertEqual(block.host_input_moved, [False, False])  # forward and recomputation
            else:
                block, ref_block = model.blocks[0], ref_model.blocks[0]
                checkpoint(block, inp, host_scale, use_reentrant=False).sum().backward()
                ref_block(inp, host_scale).sum().backward()
                self.assertEqual(block.host_input_moved, [True, True])  # forward and recomputation
            self.assertEqual(record_count(model), 0)  # freed with the region's saved tensors
        self.assert_grads_equal_reference(model, ref_model)

    # Note: the cases a review of v3 found (it raised in 1(a)-(c), where unpatched FSDP
    # runs, and recomputed 2 silently with another mask). In 1(a)-(c) the inputs are
    # already on the device, so the move changes nothing and the result must be unpatched
    # FSDP's, i.e. the same computation without FSDP; 2 must raise (the device mismatch
    # of unpatched torch) or be correct. check.py also runs 1(a)-(c) and flat 2 against
    # v3, where each fails: in flat 2 (only the root sharded) v3 compares with the latest
    # forward's RNG state and recomputes the first region with another mask.
    @parametrize(
        "case",
        [
            "review_1a_on_device_then_forward",
            "review_1a_on_device_then_no_grad_forward",
            "review_1b_on_device_no_preserve_rng_state_device_dropout",
            "review_1c_on_device_handle_without_rng_state",
            "review_2_root_twice_first_draws_device_rng",
            "review_2_nested_root_twice_first_draws_device_rng",
        ],
    )
    def test_review_case(self, case: str) -> None:
        model, ref_model, moved, inp = self.build(shard_blocks=not case.startswith("review_2") or "nested" in case)
        handle_type = StandInHandleWithoutRNGState if "without_rng_state" in case else StandInDeviceHandle
        ref_device_handle = StandInDeviceHandle(None)  # the same seed: draws what the stand-in draws
        ref_model.device_dropout = DeviceDropout(ref_device_handle)
        with self.stand_in_device(model, moved, handle_type) as device_handle:
            model.device_dropout = DeviceDropout(device_handle)
            x = moved.on_device(inp) if "on_device" in case else inp
            if case.startswith("review_1a"):
                loss = checkpoint(model, x, use_reentrant=False).sum()
                with torch.no_grad() if "no_grad" in case else contextlib.nullcontext():
                    model(x)  # another forward of the root before backward
                loss.backward()
                ref_model(inp).sum().backward()
            elif case.startswith("review_1b"):
                checkpoint(model, x, device_dropout=True, use_reentrant=False, preserve_rng_state=False).sum().backward()
                checkpoint(
                    ref_model, inp, device_dropout=True, use_reentrant=False, preserve_rng_state=False
                ).sum().backward()
            elif case.startswith("review_1c"):
                checkpoint(model, x, use_reentrant=False).sum().backward()
                ref_model(inp).sum().backward()
            else:
                # Only the first region draws device random numbers; checkpoint restores none
                # of them (its arguments are on CPU)
                first = checkpoint(model, x, device_dropout=True, use_reentrant=False)
                second = checkpoint(model, x, use_reentrant=False)
                loss = second.sum() + first.sum()
                try:
                    loss.backward()
                except StandInDeviceMismatch:
                    return  # loud, as unpatched torch on a GPU
                (ref_model(inp, device_dropout=True).sum() + ref_model(inp).sum()).backward()
        self.assert_grads_equal_reference(model, ref_model)

    # Note: the cases a review of v4 found, where v4 raised and unpatched FSDP runs (each
    # model moves its input itself): the result must be unpatched FSDP's, i.e. the same
    # computation without FSDP. check.py runs them against v4 too, where each fails.
    @parametrize(
        "case",
        [
            "cpu_input_device_dropout_after_region",
            "lengths_cpu_0d_no_preserve_rng_state_device_dropout_after_region",
            "plain_forward_with_device_dropout_then_checkpoint",
        ],
    )
    def test_review_v4_case(self, case: str) -> None:
        model, ref_model, moved, inp = self.build()
        model.moves_input_itself = ref_model.moves_input_itself = True
        ref_dropout = DeviceDropout(StandInDeviceHandle(None))  # the same seed: draws what the stand-in draws
        ref_model.device_dropout = ref_dropout
        with self.stand_in_device(model, moved) as device_handle:
            model.device_dropout = dropout = DeviceDropout(device_handle)
            if case == "cpu_input_device_dropout_after_region":
                dropout(checkpoint(model, inp, use_reentrant=False)).sum().backward()
                ref_dropout(ref_model(inp)).sum().backward()
            elif case == "lengths_cpu_0d_no_preserve_rng_state_device_dropout_after_region":
                lengths = torch.tensor(3.0)  # on CPU, 0-d; the move takes it to the device
                out = checkpoint(model, moved.on_device(inp), lengths, use_reentrant=False, preserve_rng_state=False)
                dropout(out).sum().backward()
                ref_dropout(ref_model(inp, lengths)).sum().backward()
            else:
                plain = model(inp, device_dropout=True)  # not in a checkpoint region
                (plain.sum() + checkpoint(model, inp, use_reentrant=False).sum()).backward()
                (ref_model(inp, device_dropout=True).sum() + ref_model(inp).sum()).backward()
            self.assertEqual(record_count(model), 0)
        self.assert_grads_equal_reference(model, ref_model)

    def test_records_bounded(self) -> None:
        """Forwards outside checkpoint regions record nothing and read no RNG state; a region's
        record lives while the region's saved tensors do (v4: one per grad-enabled forward, kept
        until a backward)."""
        model, _, moved, inp = self.build()
        model.moves_input_itself = True  # so that unpatched torch recomputes too
        flattens = 0

        def counting_tree_leaves(tree):
            nonlocal flattens
            flattens += 1
            return tree_leaves(tree)

        with (
            self.stand_in_device(model, moved) as device_handle,
            mock.patch.object(fsdp_state, "tree_leaves", counting_tree_leaves, create=True),
        ):
            for _ in range(50):
                model(inp)  # gradients enabled, the same CPU input
            self.assertEqual(record_count(model), 0)
            self.assertEqual((device_handle.rng_state_reads, flattens), (0, 0))
            for _ in range(50):
                checkpoint(model, inp, use_reentrant=False)  # each region freed with its output
            self.assertEqual(record_count(model), 0)
            outputs = [checkpoint(model, inp, use_reentrant=False) for _ in range(3)]
            self.assertLessEqual(record_count(model), 3)  # at most one per live region
            torch.stack(outputs).sum().backward()
            self.assertEqual(record_count(model), 0)


instantiate_parametrized_tests(TestRecomputeInputsOnCPU)

if __name__ == "__main__":
    run_tests()
