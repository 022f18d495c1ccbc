"""Recompute replay of the root input move: the recomputation draws the forward's random numbers on the device.

Note: the stand-in accelerator. FSDP2 moves a root's CPU inputs only onto an
accelerator, and ``torch.utils.checkpoint`` then saves no RNG state for it: it
saves the RNG state of the devices of its positional tensor arguments, all on CPU
here. Without a GPU, ``StandInAccelerator`` plays that device on CPU:

- after lazy init each FSDP state's device reads as ``cuda`` (FSDP2 then uses it
  only to decide the move and as its target), and the move itself (``_to_kwargs``
  in FSDP's ``_fsdp_state`` and in the plugin's replay) returns clones that the
  stand-in remembers, so "moved" can be checked;
- ``_compat_recompute.device_rng_module`` (the plugin's only access to a device's RNG)
  returns the stand-in, whose ``torch.Generator`` is the device's RNG;
- ``DeviceDropout`` draws its mask from that generator, as dropout on a CUDA
  tensor draws from the CUDA generator. Checkpoint does not know the generator,
  as it does not know a CUDA device's when every positional argument is on CPU;
- ``plugin_with_accelerator`` installs the plugin as on a machine with an
  accelerator: without one (and on a torch that casts in recompute by itself)
  its checkpoint regions keep no records (``RecomputeReplay.records_regions``).

What the stand-in cannot show: plain torch's loud failure (on a real device the
recomputation gets CPU inputs and fails with a device mismatch; here it only gets
inputs that were not moved, which the tests assert). ``TestRootDeviceMoveOnGPU``
runs the real thing where CUDA exists.
"""

from __future__ import annotations

import contextlib
import sys
import unittest
from typing import Callable, Iterator
from unittest import mock

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests
from torch.utils.checkpoint import checkpoint

from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import _recompute as _compat_recompute
from torch_fsdp_ext._recompute import _replay as recompute_replay, _state as recompute_state

from common import FSDPExtTestCase, error_text, full_grads, fully_shard, plugin, plugin_specific

DIM = 8


class StandInAccelerator:
    """A CPU stand-in for an accelerator's device module and RNG (see the module's note)."""

    def __init__(self, seed: int = 1234) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.moved: list[torch.Tensor] = []

    # The device module's RNG functions, as ``_compat_recompute.device_rng_module`` returns them.
    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        self.generator.set_state(state)

    def is_moved(self, tensor: torch.Tensor) -> bool:
        return any(tensor is moved for moved in self.moved)

    def to_kwargs(self, args, kwargs, device, use_side_stream):
        def move(value):
            if isinstance(value, torch.Tensor):
                moved = value.detach().clone().requires_grad_(value.requires_grad)
                self.moved.append(moved)
                return moved
            return value

        return (tuple(move(a) for a in args),), ({k: move(v) for k, v in kwargs.items()},)

    @contextlib.contextmanager
    def as_device_of(self, model: nn.Module) -> Iterator[None]:
        """FSDP's states of ``model`` (lazily initialized) move inputs onto this stand-in."""
        internals = _compat.load_internals()
        fsdp_state_module = sys.modules[internals.FSDPState.__module__]
        states = {fully_shard.state(m) for m in (model, *model.blocks)}
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(fsdp_state_module, "_to_kwargs", self.to_kwargs))
            stack.enter_context(mock.patch.dict(internals.symbols, to_kwargs=self.to_kwargs))
            stack.enter_context(mock.patch.object(_compat_recompute, "device_rng_module", lambda device: self))
            for state in states:
                stack.enter_context(mock.patch.object(state, "_device", torch.device("cuda")))
            yield


@contextlib.contextmanager
def plugin_with_accelerator() -> Iterator[None]:
    """The plugin installed as on a machine with an accelerator (the stand-in's)."""
    with mock.patch.object(recompute_state, "accelerator_available", lambda: True), plugin(True):
        yield


class DeviceDropout(nn.Module):
    """Dropout whose mask comes from the stand-in device's generator; records every mask."""

    def __init__(self, accelerator: StandInAccelerator, p: float = 0.5) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.p = p
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.rand(x.shape, generator=self.accelerator.generator) >= self.p
        self.masks.append(mask)
        return x * mask / (1 - self.p)


class Block(nn.Module):
    """Also takes a tensor that its caller keeps on CPU (e.g. lengths read on the host)."""

    def __init__(self, accelerator: StandInAccelerator) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.lin = nn.Linear(DIM, DIM)
        self.dropout = DeviceDropout(accelerator)
        self.host_input_moved: list[bool] = []  # per forward or recomputation

    def forward(self, x: torch.Tensor, host_scale: torch.Tensor) -> torch.Tensor:
        self.host_input_moved.append(self.accelerator.is_moved(host_scale))
        return x + self.dropout(torch.tanh(self.lin(x))) * host_scale


class Model(nn.Module):
    def __init__(self, accelerator: StandInAccelerator, root_ops: bool = True) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.in_proj = nn.Linear(DIM, DIM) if root_ops else None  # None: hands its input straight to block 0
        self.blocks = nn.ModuleList(Block(accelerator) for _ in range(2))
        self.input_moved: list[bool] = []  # per forward or recomputation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_moved.append(self.accelerator.is_moved(x))
        if self.in_proj is not None:
            x = self.in_proj(x)
        host_scale = torch.full((1,), 0.5)
        for block in self.blocks:
            x = block(x, host_scale)
        return x

    def masks(self) -> list[list[torch.Tensor]]:
        return [block.dropout.masks for block in self.blocks]


def sharded_model(rank: int, root_ops: bool = True) -> tuple[Model, StandInAccelerator, torch.Tensor]:
    """A sharded model, lazily initialized by one forward and backward, and this rank's CPU input."""
    accelerator = StandInAccelerator()
    torch.manual_seed(0)
    model = Model(accelerator, root_ops)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    inp = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    model(inp).sum().backward()
    model.zero_grad(set_to_none=True)
    model.input_moved.clear()
    for block in model.blocks:
        block.dropout.masks.clear()
        block.host_input_moved.clear()
    accelerator.generator.manual_seed(1234)
    return model, accelerator, inp


class RecomputeRNGTestCase(FSDPExtTestCase):
    def step(self, run: Callable[[Model, torch.Tensor], torch.Tensor], root_ops: bool = True) -> dict:
        """One forward and backward of ``run`` on the stand-in device; what it drew and left."""
        model, accelerator, inp = sharded_model(self.rank, root_ops)
        with accelerator.as_device_of(model):
            out = run(model, inp)
            # A draw after the region: the stream the recomputation must leave is not where the region left it.
            out = out * torch.rand(out.shape, generator=accelerator.generator)
            out.pow(2).sum().backward()
        return {
            "grads": full_grads(model),
            "masks": model.masks(),
            "input_moved": model.input_moved,
            "host_input_moved": [block.host_input_moved for block in model.blocks],
            "rng_after_backward": accelerator.generator.get_state(),
        }


def checkpointed_root(model: Model, inp: torch.Tensor, **kwargs) -> torch.Tensor:
    return checkpoint(model, inp, use_reentrant=False, **kwargs)


@plugin_specific
class TestRootInputMoveRNG(RecomputeRNGTestCase):
    WORLD_SIZE = 2

    def test_recompute_draws_the_forward_masks_and_leaves_the_rng_as_without_checkpoint(self):
        with plugin(False):
            reference = self.step(lambda model, inp: model(inp))
            unfixed = self.step(checkpointed_root)
        with plugin_with_accelerator():
            fixed = self.step(checkpointed_root)
            with mock.patch.object(recompute_replay, "replay_device_rng", lambda *args: None):
                without_rng_replay = self.step(checkpointed_root)

        # Plain torch does not move the inputs in the recomputation (on a device: a device mismatch).
        self.assertEqual(unfixed["input_moved"], [True, False])
        self.assertEqual(fixed["input_moved"], [True, True])
        # The blocks ran nested in the forward: their CPU input stays on CPU in the recomputation too.
        self.assertEqual(fixed["host_input_moved"], [[False, False], [False, False]])
        for forward_and_recompute in fixed["masks"]:
            self.assertEqual(len(forward_and_recompute), 2)
            self.assertEqual(forward_and_recompute[0], forward_and_recompute[1])
        self.assertEqual(fixed["grads"], reference["grads"], atol=0, rtol=0)
        # What fork_rng leaves for the devices checkpoint knows: the stream as if nothing was recomputed.
        self.assertEqual(fixed["rng_after_backward"], reference["rng_after_backward"])

        # The stand-in shows the bug: the replayed move alone draws other masks, other gradients.
        self.assertFalse(all(torch.equal(*masks) for masks in without_rng_replay["masks"]))
        self.assertNotEqual(without_rng_replay["grads"], reference["grads"])


@plugin_specific
class TestRootInputMoveRNGEdges(RecomputeRNGTestCase):
    WORLD_SIZE = 1

    def test_root_that_hands_its_input_to_a_nested_block(self):
        """Plain torch runs this recomputation silently wrong: block 0 claims the iteration root and moves the input."""
        with plugin(False):
            reference = self.step(lambda model, inp: model(inp), root_ops=False)
            unfixed = self.step(checkpointed_root, root_ops=False)
        with plugin_with_accelerator():
            fixed = self.step(checkpointed_root, root_ops=False)
        self.assertEqual(unfixed["input_moved"], [True, False])
        self.assertFalse(any(torch.equal(*masks) for masks in unfixed["masks"]))  # other masks, no error
        self.assertNotEqual(unfixed["grads"], reference["grads"])
        self.assertEqual(fixed["input_moved"], [True, True])
        self.assertTrue(all(torch.equal(*masks) for masks in fixed["masks"]))
        self.assertEqual(fixed["grads"], reference["grads"], atol=0, rtol=0)
        self.assertEqual(fixed["rng_after_backward"], reference["rng_after_backward"])

    def test_draw_on_the_device_before_the_move_raises(self):
        def draws_then_runs_root(model: Model, inp: torch.Tensor) -> torch.Tensor:
            noise = torch.rand(inp.shape, generator=model.accelerator.generator)
            return model(inp + noise)

        with plugin_with_accelerator(), self.assertRaises(RuntimeError) as caught:
            self.step(lambda model, inp: checkpoint(draws_then_runs_root, model, inp, use_reentrant=False))
        self.assertExpectedInline(
            error_text(caught.exception),
            """torch_fsdp_ext: a checkpointed region drew random numbers on cuda before the FSDP root FSDPModel moved its inputs there. torch.utils.checkpoint saved no RNG state for cuda (the region's positional tensor arguments are on CPU), so its recomputation cannot draw the same numbers as the forward. Move the inputs to cuda before calling checkpoint.""",
        )

    def test_device_without_rng_functions_raises(self):
        with plugin_with_accelerator(), mock.patch.object(StandInAccelerator, "get_rng_state", None):
            with self.assertRaisesRegex(RuntimeError, "cannot read the RNG state of cuda"):
                self.step(checkpointed_root)

    def test_preserve_rng_state_false_leaves_the_device_rng_alone(self):
        """Checkpoint then restores no RNG state on any device: the recomputation draws the stream's next numbers."""
        with plugin_with_accelerator():
            replayed = self.step(lambda model, inp: checkpointed_root(model, inp, preserve_rng_state=False))
        self.assertEqual(replayed["input_moved"], [True, True])
        # The stream: block 0's and block 1's masks, the draw after the region, then the recomputation's two.
        stream = torch.Generator().manual_seed(1234)
        draws = [torch.rand(4, DIM, generator=stream) >= 0.5 for _ in range(5)]
        self.assertEqual(replayed["masks"], [[draws[0], draws[3]], [draws[1], draws[4]]])
        self.assertEqual(replayed["rng_after_backward"], stream.get_state())


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.5)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@unittest.skipUnless(torch.cuda.is_available(), "needs CUDA: the root moves CPU inputs only to an accelerator")
class TestRootDeviceMoveOnGPU(FSDPExtTestCase):
    WORLD_SIZE = 1

    def run_dropout_net(self, checkpointed: bool) -> tuple[dict, torch.Tensor]:
        torch.manual_seed(0)
        model = DropoutNet().cuda()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        inp = torch.randn(4, DIM, generator=torch.Generator().manual_seed(self.rank))  # on CPU
        torch.cuda.manual_seed(1)
        out = checkpoint(model, inp, use_reentrant=False) if checkpointed else model(inp)
        out.pow(2).sum().backward()
        return full_grads(model), torch.cuda.get_rng_state()

    def test_dropout_in_checkpointed_root_with_cpu_inputs(self):
        with plugin(True):
            grads, rng_after = self.run_dropout_net(checkpointed=False)
            ck_grads, ck_rng_after = self.run_dropout_net(checkpointed=True)
        self.assertEqual(ck_grads, grads, atol=0, rtol=0)
        self.assertEqual(ck_rng_after, rng_after)
        with plugin(False), self.assertRaisesRegex(RuntimeError, "cpu"):
            self.run_dropout_net(checkpointed=True)


if __name__ == "__main__":
    run_tests()
