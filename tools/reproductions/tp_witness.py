"""The TP mantissa witness (pytorch#190626): a TP-replicated weight's gradient after FSDP2's reduction.

    python tools/reproductions/tp_witness.py

Two gloo ranks on CPU, a (dp=1, tp=2) mesh, a ``SequenceParallel`` weight, ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. Rank 0 contributes 1.0 to the weight's
gradient, rank 1 2**-10: reduced in fp32 that is 1.0009765625, in bf16 1.0. Prints one line: this torch,
whether it needs the reduce fix's gradient-dtype part (which makes the gradient in fp32 before the TP
all-reduce, as 2.15 does), and the reduced gradient without and with the reduce fix.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torch_fsdp_ext import _compat  # noqa: E402
from torch_fsdp_ext._reduce._grad_dtype import GradDtypeAtBirth  # noqa: E402

CONTRIBUTIONS = (1.0, 2.0**-10)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def reduced_grad(rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    api = _compat.fsdp2_api()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = Scale()
    parallelize_module(model, mesh["tp"], SequenceParallel())
    api.fully_shard(model, mesh=mesh["dp"], mp_policy=api.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    model(torch.ones(1, 1, 4)).to_local().float().mul(CONTRIBUTIONS[rank]).sum().backward()
    return model.weight.grad.full_tensor()[0].item()


def run(rank: int, port: int) -> None:
    import torch_fsdp_ext

    torch_fsdp_ext.uninstall()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    needed, why = GradDtypeAtBirth(_compat.load_internals()).needed()
    without = reduced_grad(rank)
    with torch_fsdp_ext.installed(["reduce"]):
        with_fix = reduced_grad(rank)
    if rank == 0:
        print(f"torch {torch.__version__}: needed={needed} ({why}); without {without!r}, with {with_fix!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(run, args=(free_port,), nprocs=2, start_method="fork")
