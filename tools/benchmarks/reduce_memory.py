"""Gradient bytes held and reduced per step: the reduce fix against plain torch, and the fp32 reduction setting
against the bf16 policy and against syncing every micro-batch.

    python tools/benchmarks/reduce_memory.py [--blocks 8] [--dim 256] [--micro-batches 4]

Two gloo ranks on CPU, ``blocks`` Linear blocks (each a ``fully_shard`` group) of an fp32 model,
``micro-batches`` micro-batches a step, the last one synchronizing. Counted, not timed, per rank:

- held: the most bytes of unsharded gradients alive at any group's post-backward (fresh and accumulated,
  before that group's reduce), and the bytes held between micro-batches (after the first one);
- reduced: the bytes handed to FSDP's reduce-scatter in one step (the gradients' numel × the reduce dtype).

Rows: ``MixedPrecisionPolicy(bf16, fp32)`` without and with the reduce fix (plain torch's rule and 2.15's
gradients born in fp32); accelerate's ``(bf16, bf16)`` policy accumulating without sync, the same with
``install(reduce_dtype=torch.float32)``, and syncing every micro-batch (accelerate's ``sync_each_batch=True``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import socket

os.environ.setdefault("TORCH_FSDP_EXT_DISABLE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import torch_fsdp_ext
from torch_fsdp_ext import _compat
from torch_fsdp_ext._patching import PatchSet

API = _compat.fsdp2_api()
BF16 = torch.bfloat16
ROWS = (
    # (name, policy's reduce dtype, reduce fix installed, fp32 reduction setting, sync every micro-batch)
    ("(bf16, fp32), plain torch", torch.float32, False, False, False),
    ("(bf16, fp32), reduce fix", torch.float32, True, False, False),
    ("(bf16, bf16), no sync", BF16, False, False, False),
    ("(bf16, bf16), reduce_dtype=float32 setting", BF16, True, True, False),
    ("(bf16, bf16), sync_each_batch", BF16, False, False, True),
)


def unsharded_grad_bytes(model: nn.Module) -> int:
    total = 0
    for state in _compat.fsdp_states_under(model):
        for group in _compat.param_groups_of(state):
            for fsdp_param in group.fsdp_params:
                unsharded = fsdp_param.__dict__.get("_unsharded_param")
                for grad in (getattr(unsharded, "grad", None), fsdp_param.__dict__.get("unsharded_accumulated_grad")):
                    if grad is not None:
                        local = getattr(grad, "_local_tensor", grad)
                        total += local.numel() * local.element_size()
    return total


def measure(rank: int, args: argparse.Namespace, row: tuple) -> tuple[int, int, int]:
    _, reduce_dtype, fix, setting, sync_each = row
    internals = _compat.load_internals()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.blocks)])
    policy = API.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    peak, reduced, between = [0], [0], 0

    def count_post_backward(original):
        def post_backward(group, *a, **k):
            peak[0] = max(peak[0], unsharded_grad_bytes(model))
            return original(group, *a, **k)
        return post_backward

    def count_reduce(original):
        signature = inspect.signature(original)

        def foreach_reduce(*a, **k):
            arguments = signature.bind(*a, **k).arguments
            grads = arguments["unsharded_grads"]
            dtype = arguments.get("reduce_dtype") or grads[0].dtype  # None: the gradients' own (torch's rule)
            reduced[0] += sum(g.numel() for g in grads) * dtype.itemsize
            return original(*a, **k)
        return foreach_reduce

    patches = PatchSet()
    patches.wrap(internals.FSDPParamGroup, "post_backward", count_post_backward)
    patches.wrap(internals.fsdp_param_group_module, "foreach_reduce", count_reduce)
    try:
        with torch_fsdp_ext.installed(["reduce"] if fix else [], reduce_dtype="float32" if setting else None):
            for block in model:
                API.fully_shard(block, mp_policy=policy)
            API.fully_shard(model, mp_policy=policy)
            for index in range(args.micro_batches):
                model.set_requires_gradient_sync(sync_each or index == args.micro_batches - 1)
                x = torch.randn(8, args.dim, generator=torch.Generator().manual_seed(index + rank))
                model(x).float().pow(2).mean().backward()
                if index == 0:
                    between = unsharded_grad_bytes(model)
    finally:
        patches.restore()
    return peak[0], between, reduced[0]


def run(rank: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = [measure(rank, args, row) for row in ROWS]
    if rank == 0:
        params = args.blocks * (args.dim * args.dim + args.dim)
        print(f"torch {torch.__version__}: {args.blocks} blocks of Linear({args.dim}), {params:,} parameters, "
              f"{args.micro_batches} micro-batches, 2 ranks; bytes per rank")
        print(f"{'setup':45} {'peak held':>12} {'held between':>13} {'reduced/step':>13}")
        for (name, *_), (peak, between, reduced) in zip(ROWS, results):
            print(f"{name:45} {peak:>12,} {between:>13,} {reduced:>13,}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(run, args=(free_port, parser.parse_args()), nprocs=2, start_method="fork")
