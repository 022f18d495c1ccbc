"""Dynamo's counters under torch.compile, plugin vs manual workaround, for the layouts of test/test_compile.py.

    python tools/benchmarks/compile_counters.py [--backend aot_eager|inductor]

Two gloo ranks on CPU; rank 0 prints one row per layout and arrangement: graph breaks,
frames, unique graphs, and whether the losses equal the workaround's bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from torch_fsdp_ext._rank_end import end_rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = ("whole", "whole+checkpoint", "block.compile() after fully_shard", "per-block before fully_shard")


def run_rank(rank: int, init_file: str, backend: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "test"))
    from test_compile import train  # the tests' own layouts, models and training loop

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = []
    for layout in LAYOUTS:
        workaround_losses, workaround = train(layout, backend, patched=False, rank=rank)
        patched_losses, patched = train(layout, backend, patched=True, rank=rank)
        for name, counters, losses in (("workaround", workaround, workaround_losses), ("plugin", patched, patched_losses)):
            rows.append([layout, name, *map(str, counters.values()), str(losses == workaround_losses)])
    if rank == 0:
        header = ["layout", "arrangement", "graph breaks", "frames", "unique graphs", "losses bitwise equal"]
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        for row in [header] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    end_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run_rank, args=(os.path.join(tmp, "init"), args.backend), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
