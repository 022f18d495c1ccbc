"""A training script that knows nothing of torch_fsdp_ext: the seed-000 model under FSDP2.

    torchrun --nproc-per-node 2 test/scripts/train_seed000.py [--steps N] [--workaround]
    python test/scripts/train_seed000.py --spawn 2 [...]    # starts its own ranks (mp.spawn)

bf16 Linears with fp32 LayerNorms in each FSDP group: without the plugin, FSDP2's first
forward fails with "FSDP expects uniform original parameter dtype". ``--workaround``
applies the manual fix (``model.float()``). Rank 0 prints one JSON line: the losses,
the parameter dtypes after training, and whether torch_fsdp_ext was imported by someone.
"""

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.lin(x)))


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(16) for _ in range(3))).to(torch.bfloat16)
    for block in model:
        block.norm.float()
    if args.workaround:
        model.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(args.steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if rank == 0:
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        print(json.dumps({"losses": losses, "dtypes": dtypes, "plugin_imported": "torch_fsdp_ext" in sys.modules,
                          "argv": sys.argv[1:]}), flush=True)
    # Note: the end docs/reliability.md recommends for a training script (torch_fsdp_ext's
    # end_rank, written out: this script never imports the plugin). os._exit skips interpreter
    # finalization, where torch's gloo workers can abort the process.
    dist.barrier()  # every rank done with its collectives
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawned_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    train(args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workaround", action="store_true")
    parser.add_argument("--spawn", type=int, default=0, help="start this many ranks with torch.multiprocessing.spawn")
    args = parser.parse_args()
    if not args.spawn:
        train(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.multiprocessing.spawn(spawned_rank, args=(args.spawn, args), nprocs=args.spawn)


if __name__ == "__main__":
    main()
