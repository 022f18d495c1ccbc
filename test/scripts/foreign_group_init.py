"""Trains the seed-000 layout (bf16 linears, fp32 norms) on one gloo rank with a library's wrapper of
``FSDPParamGroup.__init__`` (``fsdp_group_observer``) applied ``FOREIGN_ORDER``:

- ``before``: the library is imported (and wraps) before the plugin; with autoload, its import of
  FSDP puts the autoload stand-in in place, and it wraps that;
- ``after``: the plugin (or FSDP's package, with autoload) first, then the library;
- ``bypass``: the library captures the constructor at its import, before the plugin, and puts its
  wrapper in place after the plugin's import (it then calls torch's constructor directly);
- ``none`` with ``WORKAROUND=1``: the reference, ``model.float()`` before ``fully_shard``, no plugin.

The model is the first ``fully_shard``; weights trained in fp32 are loaded into block 0 after it, before
the optimizer. Prints one
JSON line: losses (hex), each parameter's dtype and a hash of its bytes, the wrapper's calls, the fixes.
"""

import hashlib
import json
import os
import sys

ORDER = os.environ["FOREIGN_ORDER"]
AUTOLOAD = os.environ.get("TORCH_FSDP_EXT_AUTOLOAD") == "1"

if ORDER in ("before", "bypass"):
    import fsdp_group_observer as observer
if not AUTOLOAD and ORDER != "none":
    import torch_fsdp_ext  # noqa: F401
if ORDER == "after":
    import torch.distributed.fsdp  # noqa: F401 - with autoload, the plugin comes right after it
    import fsdp_group_observer as observer
if ORDER == "bypass":
    observer.install()

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


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(16) for _ in range(2))).to(torch.bfloat16)
    for block in model:
        block.norm.float()
    if os.environ.get("WORKAROUND") == "1":
        model.float()
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    torch.manual_seed(1)
    source = fully_shard(Block(16))  # trained fp32 weights: uniform, never cast
    model[0].load_state_dict({k: v.detach().clone() for k, v in source.state_dict().items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    try:
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item().hex())
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    params = {
        name: [str(p.dtype), hashlib.sha256(p.full_tensor().detach().float().numpy().tobytes()).hexdigest()]
        for name, p in model.named_parameters()
    }
    plugin = sys.modules.get("torch_fsdp_ext")
    fixes = sorted(n for n, f in plugin.status().fixes.items() if f.active) if plugin else []
    calls = len(observer.CALLS) if "fsdp_group_observer" in sys.modules else 0
    print(json.dumps({"losses": losses, "params": params, "calls": calls, "fixes": fixes, "error": error}))
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
