"""Whole models against torch 2.15.0, bit for bit: the reduce fix makes gradients as 2.15 makes them.

A block (RMSNorm, an MLP, an expert MLP used where the pattern says) trains two AdamW steps of two
micro-batches on 2 gloo ranks with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, in
every cell of layouts × models × patterns:

- layouts: 1-D FSDP; HSDP (replicate 2 × shard 1); FSDP + TP (dp 1 × tp 2: the norm ``SequenceParallel``,
  the MLPs ``ColwiseParallel`` / ``RowwiseParallel``);
- models: fp32; bf16 MLPs beside an fp32 norm under ``upcast``, and under ``preserve``;
- patterns (is the expert used on each micro-batch; the last synchronizes): one micro-batch; both; only the
  synchronizing one; only the first; never; never, with ``set_reduce_scatter_unused_params(True)``.

Each cell's digest (the losses, the last gradients and the updated parameters) is compared with the one
torch 2.15.0 computed, kept in ``expected/reduce_matrix.json``: on 2.15.0 the test checks that file, on the
releases before it the plugin must give the same bits. The kernels are checked first: the same block,
computed in bf16 without FSDP, must give 2.15.0's bits too, else the releases are not comparable.
``TORCH_FSDP_EXT_WRITE_REDUCE_MATRIX=1`` on torch 2.15.0 writes the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from common import (
    HAS_DTYPE_BUG, HAS_GRAD_DTYPES_BUG, FSDPExtTestCase, MixedPrecisionPolicy, fully_shard, plugin, plugin_specific,
)
from torch_fsdp_ext import _compat

EXPECTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected", "reduce_matrix.json")
WRITE = os.environ.get("TORCH_FSDP_EXT_WRITE_REDUCE_MATRIX") == "1"
RELEASE = torch.__version__.split("+")[0]
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
DIM = 16
HAS_UNUSED_API = hasattr(_compat.fsdp2_api().FSDPModule, "set_reduce_scatter_unused_params")
# pattern -> (is the expert used on each micro-batch, reduce unused parameters)
PATTERNS = {
    "single": ((True,), False),
    "uniform": ((True, True), False),
    "sync_only": ((False, True), False),
    "first_only": ((True, False), False),
    "never": ((False, False), False),
    "unused": ((False, False), True),
}
MODELS = ("fp32", "upcast", "preserve")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.expert_up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.expert_down = nn.Linear(2 * DIM, DIM, bias=False)
        nn.init.normal_(self.norm.weight, 1.0, 0.1)

    def forward(self, x: torch.Tensor, use_expert: bool) -> torch.Tensor:
        h = self.norm(x)
        out = x + self.down(F.silu(self.up(h)))
        if use_expert:
            out = out + self.expert_down(F.silu(self.expert_up(h)))
        return out


def make_block(model: str) -> Block:
    torch.manual_seed(0)
    block = Block()
    if model != "fp32":  # bf16 MLPs as loaded, the norm kept in fp32
        for name in ("up", "down", "expert_up", "expert_down"):
            getattr(block, name).to(torch.bfloat16)
    return block


def micro_batch(rank: int, step: int, index: int) -> torch.Tensor:
    return torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(1000 * step + 100 * index + rank))


def digest(losses: list[float], tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps(losses).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def kernels_digest() -> str:
    """The block's forward, backward and an AdamW step in bf16 compute without FSDP (one process)."""
    master = make_block("fp32")
    compute = make_block("fp32").to(torch.bfloat16)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        loss = compute(micro_batch(0, step, 0).to(torch.bfloat16), True).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        for param, compute_param in zip(master.parameters(), compute.parameters()):
            param.grad = compute_param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for param, compute_param in zip(master.parameters(), compute.parameters()):
                compute_param.copy_(param)
                compute_param.grad = None
    return digest(losses, dict(master.named_parameters()))


def load_expected() -> dict[str, str]:
    with open(EXPECTED) as f:
        return json.load(f)


class TestReduceMatrix(FSDPExtTestCase):
    def shard(self, block: Block, layout: str) -> Block:
        from torch.distributed.device_mesh import init_device_mesh

        for param in block.parameters():
            dist.broadcast(param.data, 0)
        if layout == "fsdp":
            fully_shard(block, mp_policy=MP)
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
            fully_shard(block, mesh=mesh, mp_policy=MP)
        else:
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import (
                ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
            )

            mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(block, mesh["tp"], {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1)),
                "expert_up": ColwiseParallel(input_layouts=Shard(1)),
                "expert_down": RowwiseParallel(output_layouts=Shard(1)),
            })
            fully_shard(block, mesh=mesh["dp"], mp_policy=MP)
        return block

    def cell(self, layout: str, model: str, pattern: str) -> str:
        """One cell's digest, or the error it ended with."""
        uses, unused = PATTERNS[pattern]
        try:
            block = self.shard(make_block(model), layout)
            if unused:
                block.set_reduce_scatter_unused_params(True)
            optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
            losses = []
            for step in range(2):
                for index, use_expert in enumerate(uses):
                    block.set_requires_gradient_sync(index == len(uses) - 1)
                    x = micro_batch(self.rank if layout != "tp" else 0, step, index)
                    if layout == "tp":  # the sequence, sharded over the TP ranks
                        x = x.chunk(2, dim=1)[self.rank]
                    loss = block(x, use_expert).float().pow(2).mean()
                    loss.backward()
                    losses.append(loss.item())
                grads = {n: p.grad.full_tensor() for n, p in block.named_parameters() if p.grad is not None}
                optimizer.step()
                optimizer.zero_grad()
            params = {n: p.full_tensor() for n, p in block.named_parameters()}
            every_rank = [None] * self.world_size
            dist.all_gather_object(every_rank, losses)  # each rank's own losses: one digest on all ranks
            return digest(every_rank, {**params, **{f"grad.{n}": g for n, g in grads.items()}})
        except Exception as e:  # noqa: BLE001 - the cell's outcome is what is compared
            return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"

    def cells(self, layout: str, models: tuple[str, ...] = MODELS) -> dict[str, str]:
        out = {}
        for model in models:
            for pattern, (_, unused) in PATTERNS.items():
                if unused and not HAS_UNUSED_API:
                    continue
                strategy = {"preserve": "preserve"}.get(model, "upcast")
                with plugin(True, dtype_strategy=strategy):
                    out[f"{layout} {model} {pattern}"] = self.cell(layout, model, pattern)
        return out

    def check_layout(self, layout: str) -> None:
        actual = self.cells(layout)
        if WRITE and RELEASE == "2.15.0":
            if self.rank == 0:
                expected = load_expected() if os.path.exists(EXPECTED) else {}
                expected.update(actual, kernels=kernels_digest())
                with open(EXPECTED, "w") as f:
                    json.dump(expected, f, indent=1, sort_keys=True)
                    f.write("\n")
            return
        expected = load_expected()
        self.assertEqual(kernels_digest(), expected["kernels"],
                         f"the bf16 kernels of torch {RELEASE} differ from 2.15.0's: no bitwise comparison here")
        expected = {key: value for key, value in expected.items() if key in actual}
        differ = {key: (actual[key], expected[key]) for key in actual if actual[key] != expected[key]}
        self.assertFalse(differ, f"cells that differ from torch 2.15.0 on {RELEASE} (actual, 2.15.0): {differ}")

    def test_fsdp(self):
        self.check_layout("fsdp")

    def test_hsdp(self):
        self.check_layout("hsdp")

    def test_tp(self):
        self.check_layout("tp")

    @unittest.skipUnless(HAS_GRAD_DTYPES_BUG, "this torch makes gradients in reduce_dtype itself")
    @plugin_specific
    def test_without_the_reduce_fix_every_fp32_cell_fails_or_differs(self):
        """Without the reduce fix (the other fixes on) the fp32 model in 1-D FSDP: the failure of each pattern."""
        expected = load_expected()
        actual = {}
        for pattern, (_, unused) in PATTERNS.items():
            if unused and not HAS_UNUSED_API:
                continue
            with plugin(True), torch_fsdp_ext.installed():
                torch_fsdp_ext.uninstall(["reduce"])
                actual[pattern] = self.cell("fsdp", "fp32", pattern)
        same = [pattern for pattern, value in actual.items() if value == expected[f"fsdp fp32 {pattern}"]]
        self.assertEqual(same, [], actual)
        for pattern in ("sync_only", "unused"):
            if pattern in actual:
                self.assertIn("expects uniform gradient dtype", actual[pattern])


if __name__ == "__main__":
    run_tests()
