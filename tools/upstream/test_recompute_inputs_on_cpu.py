"""The scenarios of PR 2's test, on CPU: which forwards and recomputations get their inputs moved.

Note: FSDP2 moves a root's inputs only onto an accelerator (``cuda``, ``hpu``, ``xpu``,
``mtia`` or the PrivateUse1 backend), so on CPU nothing moves and PR 2's own test
(``test_fully_shard_recompute_inputs.py``) skips. Here, after lazy init, each FSDP
state's device reads as ``cuda`` (after lazy init FSDP2 uses it only for that check and
as the move's target), and ``_to_kwargs`` (the move itself, as ``_fsdp_state`` imports
it) returns clones that it remembers instead of moving: a module input that is one of
those clones was moved. The assertions are those of PR 2's test with "on the device"
read as "moved".

The device's RNG: each state's device handle (``torch.cuda`` on a CUDA device, whose
``get_rng_state`` FSDP reads) is a ``StandInDeviceHandle`` whose RNG is a
``torch.Generator`` of its own; ``DeviceDropout`` draws its mask from it, as dropout on a
CUDA tensor draws from the CUDA generator. Checkpoint does not know that generator, as
it does not know a CUDA device's when every positional argument is on CPU. In the
``*_with_device_dropout`` layouts the recomputation would draw other masks than the
forward, so the patched FSDP must raise instead of replaying the move. In
``bare_root_with_device_dropout`` (the root hands its input straight to block 0) unpatched
FSDP already runs the recomputation, silently: block 0, still idle, claims the iteration
root and moves the input.

Run by ``check.py`` against the patched FSDP2 copy. Against unpatched torch 2.15.0 every
layout of ``test_checkpoint_with_cpu_inputs`` but ``nested_blocks`` fails; of ``test_review_case``,
1(a)-(c) pass (nothing moves, so they are unpatched FSDP's computation) and both forms of 2 fail (the
stand-in cannot show the device mismatch a GPU reports; the recomputation draws another mask).
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
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "test"))
from common import FSDPExtTestCase, full_grads, fully_shard  # noqa: E402


class MovedTensors:
    """Wraps FSDP's ``_to_kwargs`` so that every tensor it moves becomes a remembered clone."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return any(tensor is moved for moved in self.tensors)

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` that reads as already on the device: the move leaves it as it is."""
        moved = tensor.detach().clone()
        self.tensors.append(moved)
        return moved

    def to_kwargs(self, args, kwargs, device, use_side_stream):
        def move(value):
            if isinstance(value, torch.Tensor) and value not in self:
                moved = value.detach().clone().requires_grad_(value.requires_grad)
                self.tensors.append(moved)
                return moved
            return value

        return (tuple(move(a) for a in args),), ({k: move(v) for k, v in kwargs.items()},)


class StandInDeviceHandle:
    """FSDP's device handle (streams etc. from the real one) with a device RNG of its own."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.generator = torch.Generator().manual_seed(1234)

    def get_rng_state(self, device=None) -> torch.Tensor:
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
        self.device_dropout: nn.Module = nn.Identity()  # applied when a forward asks for it

    def forward(self, x: torch.Tensor, device_dropout: bool = False) -> torch.Tensor:
        self.input_moved.append(x in self.moved)
        if self.root_ops:
            x = self.dropout(self.in_proj(x))
        if device_dropout:
            x = self.device_dropout(x)
        host_scale = torch.full((1,), 0.5)
        for block in self.blocks:
            x = checkpoint(block, x, host_scale, use_reentrant=False) if self.checkpoint_blocks else block(x, host_scale)
        return x


class TestRecomputeInputsOnCPU(FSDPExtTestCase):
    WORLD_SIZE = 2

    @parametrize(
        "checkpointed",
        ["root", "root_with_device_dropout", "bare_root_with_device_dropout", "nested_blocks", "block_run_alone"],
    )
    def test_checkpoint_with_cpu_inputs(self, checkpointed: str) -> None:
        moved = MovedTensors()
        torch.manual_seed(42)
        model = Model(16, moved)
        ref_model = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((4, 16))
        host_scale = torch.full((1,), 0.5)
        model(inp).sum().backward()  # lazy init from the root
        model.zero_grad(set_to_none=True)
        states = {fully_shard.state(m) for m in (model, *model.blocks)}
        device_handle = StandInDeviceHandle(fully_shard.state(model)._device_handle)
        with (
            mock.patch.multiple(fsdp_state, _to_kwargs=moved.to_kwargs),
            contextlib.ExitStack() as stack,
        ):
            for state in states:
                stack.enter_context(mock.patch.object(state, "_device", torch.device("cuda")))
                stack.enter_context(mock.patch.object(state, "_device_handle", device_handle))
            model.input_moved.clear()
            for block in model.blocks:
                block.host_input_moved.clear()
            if checkpointed == "bare_root_with_device_dropout":
                # Unpatched, block 0 claims the iteration root in the recomputation and moves the input:
                # it runs, with other masks than the forward's (no error).
                model.root_ops = False
                for block in model.blocks:
                    block.dropout = DeviceDropout(device_handle)
            elif checkpointed == "root_with_device_dropout":
                model.dropout = DeviceDropout(device_handle)
            if checkpointed.endswith("with_device_dropout"):
                loss = checkpoint(model, inp, use_reentrant=False).sum()
                with self.assertRaisesRegex(RuntimeError, "Move the inputs to cuda before calling checkpoint"):
                    loss.backward()
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
        for param in ref_model.parameters():
            if param.grad is not None:
                torch.distributed.all_reduce(param.grad)
                param.grad.div_(self.world_size)
        ref_grads = {name: p.grad for name, p in ref_model.named_parameters() if p.grad is not None}
        self.assertEqual(full_grads(model), ref_grads)


    # Note: the cases a review of the previous design found (it raised in 1(a)-(c), where
    # unpatched FSDP runs, and recomputed 2 silently with another mask). In 1(a)-(c) the
    # inputs are already on the device, so the move changes nothing and the result must
    # be unpatched FSDP's, i.e. the same computation without FSDP; 2 must raise or be
    # correct. check.py also runs 1(a)-(c) and flat 2 against the previous design, where
    # each fails: in flat 2 (only the root sharded) it compares with the latest forward's
    # RNG state and recomputes the first region with another mask. With the blocks sharded
    # too (nested 2) the previous design raises, from block 0 claiming the iteration root
    # during the recomputation; PR 2 must stay loud or correct there as well.
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
        moved = MovedTensors()
        torch.manual_seed(42)
        model = Model(16, moved)
        ref_model = copy.deepcopy(model)
        if not case.startswith("review_2") or "nested" in case:
            for block in model.blocks:
                fully_shard(block)
        fully_shard(model)
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((4, 16))
        model(inp).sum().backward()  # lazy init from the root
        model.zero_grad(set_to_none=True)
        states = {fully_shard.state(m) for m in model.modules() if isinstance(m, FSDPModule)}
        handle_type = StandInHandleWithoutRNGState if "without_rng_state" in case else StandInDeviceHandle
        device_handle = handle_type(fully_shard.state(model)._device_handle)
        ref_device_handle = StandInDeviceHandle(None)  # the same seed: draws what device_handle draws
        model.device_dropout = DeviceDropout(device_handle)
        ref_model.device_dropout = DeviceDropout(ref_device_handle)
        on_device = "on_device" in case
        with (
            mock.patch.multiple(fsdp_state, _to_kwargs=moved.to_kwargs),
            contextlib.ExitStack() as stack,
        ):
            for state in states:
                stack.enter_context(mock.patch.object(state, "_device", torch.device("cuda")))
                stack.enter_context(mock.patch.object(state, "_device_handle", device_handle))
            x = moved.on_device(inp) if on_device else inp
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
                except RuntimeError as error:
                    self.assertIn("Move the inputs to cuda before calling checkpoint", str(error))
                    return  # loud
                (ref_model(inp, device_dropout=True).sum() + ref_model(inp).sum()).backward()
        for param in ref_model.parameters():
            if param.grad is not None:
                torch.distributed.all_reduce(param.grad)
                param.grad.div_(self.world_size)
        ref_grads = {name: p.grad for name, p in ref_model.named_parameters() if p.grad is not None}
        self.assertEqual(full_grads(model), ref_grads)


instantiate_parametrized_tests(TestRecomputeInputsOnCPU)

if __name__ == "__main__":
    run_tests()
