"""A mixed-dtype model trained under dtype_strategy upcast, then preserve, with the plugin, under torchrun.

    torchrun ... test/scripts/train_rank_check.py --out DIR [--fail-in-first-attempt]

bf16 Linears with fp32 LayerNorms in each FSDP group, bf16 compute. Each rank writes
``DIR/rank{R}.attempt{A}.json``: its losses per strategy, its parameter dtypes, and
how many rank-consistency comparisons its process group made in this elastic attempt.
``--fail-in-first-attempt``: rank 1 of attempt 0 exits right after its first forward.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torch_fsdp_ext
from torch_fsdp_ext._rank_consistency import comparisons_made
from torch_fsdp_ext._rank_end import end_rank


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.lin(x)))


def train(rank: int, steps: int, fail: bool) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(16) for _ in range(3))).to(torch.bfloat16)
    for block in model:
        block.norm.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).float().pow(2).mean()
        if fail:
            os._exit(1)  # a rank lost mid-iteration, after the comparison of the first forward
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, sorted({str(p.dtype) for p in model.parameters()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-in-first-attempt", action="store_true")
    args = parser.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Note: the agent's store outlives an attempt, and gloo's own connection setup would read the
    # addresses the failed attempt left there (connection refused), so each attempt takes a prefix.
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", agent_store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    fail = args.fail_in_first_attempt and attempt == 0 and rank == 1
    report = {"world": dist.get_world_size()}
    for strategy in ("upcast", "preserve"):
        with torch_fsdp_ext.installed(dtype_strategy=strategy):
            report[strategy] = train(rank, args.steps, fail)
    report["comparisons"] = comparisons_made(dist.group.WORLD)
    with open(os.path.join(args.out, f"rank{rank}.attempt{attempt}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    end_rank()


if __name__ == "__main__":
    main()
