"""What a checkpointed step leaves alive with the cyclic garbage collector off: plain torch vs the plugin.

    python tools/benchmarks/recompute_refcount.py

One row per setup on this torch: 4 FSDP blocks under an FSDP root, each block in a non-reentrant
``checkpoint``, SGD. "steps": 10 forward+backward+step; "dropped": 10 forwards whose output is
dropped without backward. Counted after each, with ``gc`` disabled for the whole run and never
collected: live ``_CheckpointFrame`` objects, live ``FrameRecords`` and live region inputs (the
tensor each checkpoint got, followed by weak references). The plugin runs as on a machine with an
accelerator (``accelerator_available`` answers True), where its regions keep records. Exits 1 when
the plugin leaves more alive than plain torch.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import weakref
from unittest import mock

os.environ.setdefault("TORCH_FSDP_EXT_DISABLE", "1")  # each setup chooses explicitly

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext._compat import fsdp2_api
from torch_fsdp_ext._recompute import _state as recompute_state
from torch_fsdp_ext._recompute._frames import FrameRecords

DIM, BLOCKS, RUNS = 16, 4, 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(BLOCKS))
        self.region_inputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            self.region_inputs.append(weakref.ref(x))
            x = checkpoint(block, x, use_reentrant=False)
        return x


def live(type_name: str) -> int:
    return sum(type(o).__name__ == type_name for o in gc.get_objects())


def run(backward: bool) -> tuple[int, int, int]:
    """Live frames, records and region inputs after RUNS steps (or dropped forwards), counted without collecting."""
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fsdp2_api().fully_shard(block)
    fsdp2_api().fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = live("_CheckpointFrame"), live(FrameRecords.__name__)
    for _ in range(RUNS):
        out = model(torch.randn(4, DIM, requires_grad=True))
        if backward:
            out.pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del out
    inputs = sum(ref() is not None for ref in model.region_inputs)
    return live("_CheckpointFrame") - before[0], live(FrameRecords.__name__) - before[1], inputs


def main() -> int:
    gc.disable()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        for backward, scenario in ((True, "steps"), (False, "dropped")):
            torch_fsdp_ext.uninstall()
            rows[("plain torch", scenario)] = run(backward)
            with mock.patch.object(recompute_state, "accelerator_available", lambda: True):
                torch_fsdp_ext.install()
            rows[("plugin", scenario)] = run(backward)
            torch_fsdp_ext.uninstall()
        dist.destroy_process_group()
    print(f"torch {torch.__version__}, {BLOCKS} checkpointed FSDP blocks, {RUNS} runs, cyclic GC off, never collected")
    print(f"{'setup':12} {'scenario':9} {'frames':>7} {'records':>8} {'inputs':>7}")
    for (setup, scenario), counts in rows.items():
        print(f"{setup:12} {scenario:9} {counts[0]:7} {counts[1]:8} {counts[2]:7}")
    leaks = [s for s in ("steps", "dropped") if rows[("plugin", s)] != rows[("plain torch", s)]]
    print("plugin leaves alive what plain torch does" if not leaks else f"PLUGIN LEAVES MORE ALIVE: {leaks}")
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
