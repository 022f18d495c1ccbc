"""Checkpoint-recompute cases under FSDP2, each run without and with the plugin.

    python tools/reproductions/recompute_cases.py            # NCCL + CUDA when a GPU exists, else gloo on CPU

Runs the seed script of pytorch#148831 as written (FSDP1 and FSDP2, world size 1)
and the eight checkpoint flavours of issue 4, and prints one line per case:
the outcome without the plugin and with it. "ok" means the gradients equal those
of the same model run without checkpointing, bit for bit.
"""

from __future__ import annotations

import functools
import os
import tempfile

os.environ.setdefault("TORCH_FSDP_EXT_DISABLE", "1")

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext._compat import fsdp2_api
from torch_fsdp_ext._rank_end import end_rank

fully_shard, MixedPrecisionPolicy = fsdp2_api().fully_shard, fsdp2_api().MixedPrecisionPolicy

DIM = 64
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_OUT32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.lin1, self.lin2, self.dropout = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(self.dropout(F.gelu(self.lin1(F.gelu(x)))))


class KwargsBlock(Block):
    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, wrap=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList((wrap or (lambda b: b))(Block()) for _ in range(3))

    def forward(self, x: torch.Tensor, run=None) -> torch.Tensor:
        for block in self.blocks:
            x = run(block, x) if run else block(x)
        return x


def shard(model: nn.Module, policy: MixedPrecisionPolicy) -> nn.Module:
    for block in getattr(model, "blocks", []):
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def non_reentrant(block, x):
    return checkpoint(block, x, use_reentrant=False)


def checkpoint_wrapped(block):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def composable_checkpointed(block):
    from torch.distributed._composable import checkpoint as composable_checkpoint

    composable_checkpoint(block)
    return block


def sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])


# name -> (build(checkpointed), step(model, x, checkpointed), autocast)
CASES = {
    "1 checkpoint(fsdp_module)": (lambda c: shard(Block(), BF16), lambda m, x, c: non_reentrant(m, x) if c else m(x), False),
    "1 same, under autocast": (lambda c: shard(Block(), BF16), lambda m, x, c: non_reentrant(m, x) if c else m(x), True),
    # No dropout: checkpoint does not restore the CUDA RNG for CPU inputs (docs/how-it-works.md, "Recompute and RNG state").
    "2 root, CPU inputs": (lambda c: shard(Block(dropout=0.0), BF16), lambda m, x, c: non_reentrant(m, x.cpu()) if c else m(x.cpu()), True),
    "2 kwargs-only inputs": (
        lambda c: shard(KwargsBlock(), BF16),
        lambda m, x, c: checkpoint(m, x=x, use_reentrant=False) if c else m(x=x), False),
    "3 per-block, nested fully_shard": (lambda c: shard(Net(), BF16_OUT32), lambda m, x, c: m(x, non_reentrant if c else None), False),
    "4 checkpoint_wrapper first": (lambda c: shard(Net(checkpoint_wrapped if c else None), BF16_OUT32), lambda m, x, c: m(x), False),
    "4 composable checkpoint": (lambda c: shard(Net(composable_checkpointed if c else None), BF16_OUT32), lambda m, x, c: m(x), False),
    "5 selective AC": (
        lambda c: shard(Block(), BF16),
        lambda m, x, c: checkpoint(m, x, use_reentrant=False, context_fn=sac_context) if c else m(x), False),
    "6 reentrant": (
        lambda c: shard(Net(), BF16_OUT32),
        lambda m, x, c: m(x, functools.partial(checkpoint, use_reentrant=True) if c else None), False),
    "7 grad accumulation": (
        lambda c: shard(Net(), BF16_OUT32),
        lambda m, x, c: m(x, non_reentrant if c else None) + m(2 * x, non_reentrant if c else None), False),
    "7 module twice in a region": (
        lambda c: shard(Net(), BF16_OUT32),
        lambda m, x, c: (non_reentrant if c else (lambda f, y: f(y)))(lambda y: m.blocks[0](m.blocks[0](y)), x), False),
    "8 param_dtype fp16": (
        lambda c: shard(Block(), MixedPrecisionPolicy(param_dtype=torch.float16)),
        lambda m, x, c: non_reentrant(m, x) if c else m(x), False),
    "8 output_dtype fp32": (lambda c: shard(Block(), BF16_OUT32), lambda m, x, c: non_reentrant(m, x) if c else m(x), False),
    "8 cast_forward_inputs=False": (
        lambda c: shard(Block(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)),
        lambda m, x, c: non_reentrant(m, x) if c else m(x), True),
}


def run_case(build, step, autocast: bool, device: torch.device) -> str:
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build(checkpointed)
        x = torch.randn(8, DIM, device=device, requires_grad=True)
        torch.manual_seed(1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = step(model, x, checkpointed)
        out.float().pow(2).mean().backward()
        grads.append([x.grad] + [p.grad.full_tensor() for p in model.parameters() if p.grad is not None])
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    return "ok" if same else "wrong gradients"


def outcome(fn, *args) -> str:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        return type(e).__name__


def seed_script(implementation: str, device: torch.device) -> str:
    """pytorch#148831's reproducer: checkpoint(module, x) under autocast, FSDP1 or FSDP2."""

    class CheckpointedModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = nn.Linear(2048, 2048)

        def forward(self, x):
            return self.linear1(nn.functional.gelu(x))

    if implementation == "FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        model = FSDP(CheckpointedModule().to(device), mixed_precision=mp, device_id=device if device.type == "cuda" else None)
    else:
        model = fully_shard(CheckpointedModule(), mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16))
    x = torch.randn(256, 2048, device=device, requires_grad=True)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        out = checkpoint(model, x, use_reentrant=False)
        out.sum().backward()
    return "ok"


def main() -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        print(f"torch {torch.__version__}, {'NCCL on ' + torch.cuda.get_device_name() if cuda else 'gloo on CPU'}, world size 1")
        rows = []
        for implementation in ("FSDP1", "FSDP2"):
            if implementation == "FSDP1" and not cuda:  # FSDP1 needs an accelerator
                rows.append([f"seed script, {implementation}", "n/a on CPU", "n/a on CPU"])
                continue
            results = []
            for plugin in (False, True):
                (torch_fsdp_ext.install if plugin else torch_fsdp_ext.uninstall)()
                results.append(outcome(seed_script, implementation, device))
            rows.append([f"seed script, {implementation}", *results])
        for name, (build, step, autocast) in CASES.items():
            if name.startswith("2 root") and not cuda:
                rows.append([name, "n/a on CPU", "n/a on CPU"])
                continue
            results = []
            for plugin in (False, True):
                (torch_fsdp_ext.install if plugin else torch_fsdp_ext.uninstall)()
                results.append(outcome(run_case, build, step, autocast, device))
            rows.append([name, *results])
        dist.destroy_process_group()
    width = max(len(r[0]) for r in rows)
    print(f"{'case'.ljust(width)}  {'without plugin'.ljust(16)}  with plugin")
    for name, without, with_plugin in rows:
        print(f"{name.ljust(width)}  {without.ljust(16)}  {with_plugin}")
    failed = [r[0] for r in rows if r[2] not in ("ok", "n/a on CPU")]
    print("all cases ok with the plugin" if not failed else f"FAILED with the plugin: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    end_rank(exit_status=main())  # no interpreter shutdown: docs/reliability.md, "Abort at exit"
