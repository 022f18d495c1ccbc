"""The review cases of a replayed root input move, on the plugin's own replay: where unpatched torch runs, the
plugin adds no error, computes the same bit for bit, and holds no record beyond the regions still alive.

A review of an upstream replay of the root's input move (``tools/upstream``, PR 2 v4) found models that move
what they need themselves, so that unpatched recomputation works, where that replay raised; and records that
grew with every grad-enabled forward until a backward. The same cases run here against the plugin, on the
stand-in accelerator of ``test_recompute_rng`` (FSDP's states read as ``cuda``, the move returns remembered
clones, ``DeviceDropout`` draws from the stand-in device's generator, which checkpoint does not know):

1. ``checkpoint(root, x_cpu)`` with a device dropout after the region;
2. ``checkpoint(root, x_dev, lengths_cpu_0d, preserve_rng_state=False)`` with a device dropout after it;
3. ``root(x_cpu, device_dropout=True)`` (a plain forward that draws on the device, its output kept) and then
   ``checkpoint(root, x_cpu)`` without dropout;
4. 50 grad-enabled forwards of the same CPU input and no backward, then checkpointed forwards kept alive.

In 1-3 no random number is drawn inside a checkpointed region, so unpatched recomputation draws nothing either
and runs (here as on a GPU, where these models move their host tensors themselves); the plugin must give the
same loss, gradients and device RNG stream after backward.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext._compat import _recompute as _compat_recompute
from torch_fsdp_ext._recompute._frames import FrameRecords

from common import FSDPExtTestCase, full_grads, fully_shard, plugin, plugin_specific
from test_recompute_refcount import cyclic_gc_off, live_objects
from test_recompute_rng import DeviceDropout, StandInAccelerator, plugin_with_accelerator

DIM = 8


class Root(nn.Module):
    """An FSDP root with nested FSDP blocks; a device dropout only where a call asks for it."""

    def __init__(self, accelerator: StandInAccelerator) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.in_proj = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.dropout = DeviceDropout(accelerator)
        self.input_moved: list[bool] = []  # per forward or recomputation

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None, device_dropout: bool = False):
        self.input_moved.append(self.accelerator.is_moved(x))
        x = self.in_proj(x)
        if device_dropout:
            x = self.dropout(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        if lengths is not None:  # a 0-d host tensor (e.g. a length read on the host), used as it comes
            x = x / lengths
        return x


def sharded_root(rank: int) -> tuple[Root, StandInAccelerator, torch.Tensor]:
    """A sharded root, lazily initialized by one forward and backward, and this rank's CPU input."""
    accelerator = StandInAccelerator()
    torch.manual_seed(0)
    model = Root(accelerator)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    model.input_moved.clear()
    accelerator.generator.manual_seed(1234)
    return model, accelerator, x


def live_frame_records() -> int:
    return live_objects(FrameRecords.__name__)  # not collected: records die by reference counting


def after_region(model: Root, out: torch.Tensor) -> torch.Tensor:
    """A device dropout after the checkpointed region: the device RNG moves on before the recomputation."""
    return model.dropout(out)


def case_1_dropout_after_region(model: Root, x: torch.Tensor) -> torch.Tensor:
    return after_region(model, checkpoint(model, x, use_reentrant=False)).pow(2).sum()


def case_2_host_scalar_without_rng_preservation(model: Root, x: torch.Tensor) -> torch.Tensor:
    lengths = torch.tensor(3.0)  # 0-d, on the host; FSDP's root moves it with x
    out = checkpoint(model, x, lengths, use_reentrant=False, preserve_rng_state=False)
    return after_region(model, out).pow(2).sum()


def case_3_plain_forward_then_checkpointed(model: Root, x: torch.Tensor) -> torch.Tensor:
    model.plain_output = model(x, device_dropout=True)  # kept: its graph waits for a backward that never comes
    return checkpoint(model, x, use_reentrant=False).pow(2).sum()


@plugin_specific
class TestReviewCasesOfTheInputMoveReplay(FSDPExtTestCase):
    WORLD_SIZE = 1

    def step(self, case) -> dict:
        model, accelerator, x = sharded_root(self.rank)
        with accelerator.as_device_of(model):
            loss = case(model, x)
            loss.backward()
        return {
            "loss": loss.detach(),
            "grads": full_grads(model),
            "masks": model.dropout.masks,
            "rng_after_backward": accelerator.generator.get_state(),
            "input_moved": model.input_moved,
        }

    def check_equal_to_unpatched(self, case, moved_plain: list[bool], moved_fixed: list[bool]) -> None:
        with plugin(False):
            plain = self.step(case)
        with plugin_with_accelerator(), cyclic_gc_off():
            fixed = self.step(case)  # raises where the plugin adds an error
            self.assertEqual(live_frame_records(), 0)
        # Per forward and recomputation: the plugin replays the move; unpatched torch leaves the inputs as they are.
        self.assertEqual(plain["input_moved"], moved_plain)
        self.assertEqual(fixed["input_moved"], moved_fixed)
        self.assertEqual(fixed["loss"], plain["loss"], atol=0, rtol=0)
        self.assertEqual(fixed["grads"], plain["grads"], atol=0, rtol=0)
        self.assertEqual(fixed["masks"], plain["masks"], atol=0, rtol=0)
        self.assertEqual(fixed["rng_after_backward"], plain["rng_after_backward"], atol=0, rtol=0)

    def test_1_dropout_after_the_region(self):
        self.check_equal_to_unpatched(case_1_dropout_after_region, [True, False], [True, True])

    def test_2_host_scalar_and_preserve_rng_state_false(self):
        self.check_equal_to_unpatched(case_2_host_scalar_without_rng_preservation, [True, False], [True, True])

    def test_3_plain_forward_does_not_block_the_checkpointed_one(self):
        # The plain forward, the checkpointed forward, its recomputation.
        self.check_equal_to_unpatched(case_3_plain_forward_then_checkpointed, [True, True, False], [True, True, True])

    def test_4_records_do_not_grow_and_die_with_their_regions(self):
        live_records = []  # after the 50 plain forwards, with 3 checkpointed regions alive, after those are freed
        rng_reads = []  # of the device's RNG state by the plugin, in the 50 plain forwards

        def forwards(model: Root, x: torch.Tensor) -> torch.Tensor:
            with mock.patch.object(_compat_recompute, "device_rng_state", wraps=_compat_recompute.device_rng_state) as read:
                kept = [model(x) for _ in range(50)]  # grad-enabled, no backward: nothing checkpointed
            rng_reads.append(read.call_count)
            live_records.append(live_frame_records())
            regions = [checkpoint(model, x, use_reentrant=False) for _ in range(3)]
            live_records.append(live_frame_records())
            del regions  # their graphs, frames and records with them
            live_records.append(live_frame_records())
            del kept
            return checkpoint(model, x, use_reentrant=False).pow(2).sum()

        with plugin(False), cyclic_gc_off():
            plain = self.step(forwards)
        self.assertEqual(live_records, [0, 0, 0])
        live_records.clear()
        with plugin_with_accelerator(), cyclic_gc_off():
            fixed = self.step(forwards)
            self.assertEqual(live_records, [0, 3, 0])  # one per live region, each holding its move
            self.assertEqual(live_frame_records(), 0)
            fix = torch_fsdp_ext._install._active["recompute"][0]
            self.assertEqual((fix.frames.stack, fix.frames.recompute), ([], None))
        self.assertEqual(rng_reads, [0, 0])  # a forward outside every region costs the plugin nothing
        self.assertEqual(fixed["loss"], plain["loss"], atol=0, rtol=0)
        self.assertEqual(fixed["grads"], plain["grads"], atol=0, rtol=0)
        self.assertEqual(fixed["rng_after_backward"], plain["rng_after_backward"], atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
