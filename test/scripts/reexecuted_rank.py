"""A training script whose launcher re-executes its second rank, as Lightning's ``ModelParallelStrategy`` does.

    python -m torch_fsdp_ext.run test/scripts/reexecuted_rank.py

Rank 0 starts rank 1 as ``python reexecuted_rank.py`` (with the environment it was given,
so ``TORCH_FSDP_EXT_AUTOLOAD=1`` reaches it). Like ``import lightning``, the script imports
``torch._dynamo`` before anything else, which imports FSDP's package while ``torch._dynamo``
is half loaded. Each rank trains the seed-000 model with per-block activation checkpointing
and prints one JSON line: its rank, the fixes installed, and its losses.
"""

import json
import os
import socket
import subprocess
import sys

import torch._dynamo  # noqa: F401 - what `import lightning` imports first

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: self.norm(t + torch.relu(self.lin(t))), x, use_reentrant=False)


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    child = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=dict(os.environ, RANK="1"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(16) for _ in range(2))).to(torch.bfloat16)
    for block in model:
        block.norm.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    plugin = sys.modules.get("torch_fsdp_ext")
    fixes = sorted(name for name, fix in plugin.status().fixes.items() if fix.active) if plugin else []
    # One write per line: both ranks write to the same pipe.
    sys.stdout.write(json.dumps({"rank": rank, "fixes": fixes, "losses": losses}) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    status = child.wait() if child is not None else 0
    # Note: ends without interpreter finalization, where a gloo worker can abort the process
    # ("terminate called without an active exception"; torch_fsdp_ext/_rank_end.py says why).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
