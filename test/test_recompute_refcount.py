"""Checkpointed regions die by reference counting with the plugin as without it.

Counted with the cyclic garbage collector off for the whole run and never collected: live
``_CheckpointFrame`` objects, the plugin's ``FrameRecords`` and the regions' inputs (followed by
weak references). Plain torch frees a region's frame, and with it the inputs it saved, when the
region's graph goes: after its backward, or when a forward's output is dropped without one. A
reference cycle through what the plugin attaches to the frame would keep all three alive until the
collector runs, which ``gc.collect()`` before counting would hide. The plugin runs as on a machine
with an accelerator (``plugin_with_accelerator``), where its regions keep records.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests
from torch.utils.checkpoint import checkpoint

from torch_fsdp_ext._recompute._frames import FrameRecords

from common import HAS_RECOMPUTE_CAST_BUG, FSDPExtTestCase, MixedPrecisionPolicy, fully_shard, plugin, plugin_specific
from test_recompute_rng import plugin_with_accelerator, sharded_model

DIM, BLOCKS, RUNS = 8, 4, 5


@contextlib.contextmanager
def cyclic_gc_off() -> Iterator[None]:
    """The cyclic garbage collector off for a block: what is alive then lives by reference counting alone."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def live_objects(type_name: str) -> int:
    """Objects of the type named ``type_name`` alive now, counted without collecting."""
    return sum(type(o).__name__ == type_name for o in gc.get_objects())


class Counts:
    """Live frames, records and region inputs, relative to when counting began."""

    def __init__(self) -> None:
        self.inputs: list[weakref.ref] = []
        self.frames_before = live_objects("_CheckpointFrame")
        self.records_before = live_objects(FrameRecords.__name__)

    def region_input(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(weakref.ref(x))
        return x

    def now(self) -> tuple[int, int, int]:
        return (
            live_objects("_CheckpointFrame") - self.frames_before,
            live_objects(FrameRecords.__name__) - self.records_before,
            sum(ref() is not None for ref in self.inputs),
        )


class BlockNet(nn.Module):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, self.counts.region_input(x), use_reentrant=False)
        return x


Build = Callable[[Counts], tuple[nn.Module, Callable[[], torch.Tensor], contextlib.AbstractContextManager]]


def per_block_regions(counts: Counts, policy: MixedPrecisionPolicy) -> tuple:
    """4 FSDP blocks under an FSDP root, each block a checkpointed region."""
    torch.manual_seed(0)
    model = BlockNet(counts)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, lambda: model(torch.randn(4, DIM, requires_grad=True)), contextlib.nullcontext()


@plugin_specific
class TestRegionsDieByReferenceCounting(FSDPExtTestCase):
    WORLD_SIZE = 1

    def run_regions(self, build: Build, backward: bool) -> tuple[list, tuple[int, int, int]]:
        """Counts while each forward's graph is alive, and after RUNS of them went (steps, or dropped forwards)."""
        with cyclic_gc_off():
            counts = Counts()
            model, forward, context = build(counts)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            alive = []
            with context:
                for _ in range(RUNS):
                    out = forward()
                    alive.append(counts.now())
                    if backward:
                        out.pow(2).mean().backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    del out
            return alive, counts.now()

    def check_as_plain_torch(self, build: Build, regions: int, plain_backward: bool = True) -> None:
        """Each forward's ``regions`` die with its graph, with the plugin as in plain torch."""
        for backward in (True, False):
            with plugin(False):
                # Where plain torch cannot run the backward, its dropped forwards are the reference.
                plain = self.run_regions(build, backward and plain_backward)
            with plugin_with_accelerator():
                fixed = self.run_regions(build, backward)
            # While a forward's graph is alive: its regions' frames and inputs, and with the plugin one record each.
            self.assertEqual(plain[0], [(regions, 0, regions)] * RUNS)
            self.assertEqual(fixed[0], [(regions, regions, regions)] * RUNS)
            self.assertEqual(plain[1], (0, 0, 0))
            self.assertEqual(fixed[1], plain[1], f"backward={backward}: (frames, records, inputs) left alive")

    def test_per_block_regions(self):
        self.check_as_plain_torch(lambda counts: per_block_regions(counts, MixedPrecisionPolicy()), BLOCKS)

    def test_per_block_regions_mixed_precision_under_autocast(self):
        # Records that replay: the forward's autocast, and the casts where this torch skips them in recompute.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)

        def build(counts: Counts) -> tuple:
            model, forward, context = per_block_regions(counts, policy)

            def autocast_forward() -> torch.Tensor:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return forward().float()

            return model, autocast_forward, context

        self.check_as_plain_torch(build, BLOCKS, plain_backward=not HAS_RECOMPUTE_CAST_BUG)

    def test_checkpointed_root_with_a_replayed_input_move(self):
        # On the stand-in accelerator: each record holds the device's RNG state, each recomputation replays it.
        def build(counts: Counts) -> tuple:
            model, accelerator, inp = sharded_model(self.rank)
            forward = lambda: checkpoint(model, counts.region_input(inp.clone()), use_reentrant=False)  # noqa: E731
            return model, forward, accelerator.as_device_of(model)

        self.check_as_plain_torch(build, regions=1)


if __name__ == "__main__":
    run_tests()
