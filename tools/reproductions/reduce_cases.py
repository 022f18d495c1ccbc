"""The reduce fix's cases, each run without and with the plugin on 2 gloo ranks.

    python tools/reproductions/reduce_cases.py

One fp32 model (``a`` used on every micro-batch, ``b`` where the case says) in one ``fully_shard`` group with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, one line per case: the outcome without the plugin
and with it. "equal" means the reduced gradients and the SGD-updated parameters equal, bit for bit, a hand
reference: each rank's gradients computed in bf16 by a plain copy of the model, cast to fp32, accumulated over the
micro-batches and averaged over the ranks (what torch 2.15 computes). Then a unit that never ran forward
(pytorch#194058), and a second table of mantissa witnesses: a weight's gradient after two micro-batches
contributing 1.0 and 2**-10 (1.0009765625 summed in fp32, 1.0 in bf16), without the plugin, with it, and with
``TORCH_FSDP_EXT_REDUCE_DTYPE=float32``.
"""

from __future__ import annotations

import copy
import os
import tempfile

os.environ.setdefault("TORCH_FSDP_EXT_DISABLE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import torch_fsdp_ext
from torch_fsdp_ext._compat import fsdp2_api

API = fsdp2_api()
fully_shard, MixedPrecisionPolicy, FSDPModule = API.fully_shard, API.MixedPrecisionPolicy, API.FSDPModule
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LR = 0.1
WORLD_SIZE = 2
# case -> (uses b on each micro-batch, the last one synchronizing; the upstream thread)
CASES = {
    "accumulation, b first on the sync micro-batch": ((False, True), "#196996, #160279"),
    "set_reduce_scatter_unused_params(True) + accumulation": ((False, False), "#196996"),
    "first forward frozen, then unfrozen": ((True,), "#186998"),
}


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def micro_batch(rank: int, index: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * index + rank))


def reference(model: nn.Module, uses_b: tuple[bool, ...], rank: int) -> tuple[dict, dict]:
    compute, updated = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(model)
    accumulated: dict[str, torch.Tensor] = {}
    for index, use_b in enumerate(uses_b):
        compute.zero_grad(set_to_none=True)
        compute(micro_batch(rank, index).to(torch.bfloat16), use_b).float().pow(2).mean().backward()
        for name, param in compute.named_parameters():
            if param.grad is not None:
                accumulated[name] = accumulated.get(name, 0) + param.grad.float()
    grads = {}
    for name, param in updated.named_parameters():
        total = accumulated.get(name, torch.zeros_like(param)).clone()
        dist.all_reduce(total)
        grads[name] = param.grad = total / WORLD_SIZE
    torch.optim.SGD(updated.parameters(), lr=LR).step()
    return grads, {name: p.detach() for name, p in updated.named_parameters()}


def run_case(case: str, rank: int) -> str:
    uses_b = CASES[case][0]
    if "unused" in case and not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return "no such API"
    torch.manual_seed(0)
    model = Branches()
    expected_grads, expected_params = reference(model, uses_b, rank)
    fully_shard(model, mp_policy=MP)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        if "unused" in case:
            model.set_reduce_scatter_unused_params(True)
        if "frozen" in case:
            model.requires_grad_(False)
            with torch.no_grad():
                model(micro_batch(rank, 99), True)
            model.requires_grad_(True)
        for index, use_b in enumerate(uses_b):
            model.set_requires_gradient_sync(index == len(uses_b) - 1)
            model(micro_batch(rank, index), use_b).float().pow(2).mean().backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        optimizer.step()
    except Exception as e:  # noqa: BLE001 - the outcome is the table
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    equal = all(torch.equal(grads[n], expected_grads[n]) and torch.equal(params[n], expected_params[n])
                for n in expected_grads)
    return "equal" if equal else "differs"


class Scale(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.dtype) * self.weight


class ScaleWithRouter(nn.Module):
    """A bf16 weight beside an fp32 router: under ``upcast`` the weight becomes an fp32 master."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.router = Scale(torch.bfloat16), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x).float() + 0.0 * self.router(x.float())


class Tower(nn.Module):
    """A text path ``a`` and a vision tower ``b``, a ``fully_shard`` unit of its own, unused on text batches."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def witness(case: str) -> str:
    """The weight's gradient after micro-batches contributing 1.0 and 2**-10 (no sync between them)."""
    if case.startswith("upcast"):
        model = ScaleWithRouter()
        fully_shard(model)
        torch_fsdp_ext.upcast_now(model)
        weight = model.scale.weight
    else:
        model = Scale(torch.bfloat16 if case.startswith("grad_dtype") else torch.float32)
        if case.startswith("grad_dtype"):
            model.weight.grad_dtype = torch.float32
        policy = {"bf16 policy": MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16),
                  "param_dtype-only policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}.get(case)
        fully_shard(model, **({"mp_policy": policy} if policy else {}))
        weight = model.weight
    for index, contribution in enumerate((1.0, 2.0**-10)):
        model.set_requires_gradient_sync(index == 1)
        model(torch.full((4,), contribution)).float().sum().backward()
    grad = weight.grad.full_tensor()
    return f"{str(grad.dtype).replace('torch.', '')} {grad[0].item()!r}"


def never_ran(rank: int) -> str:
    """Text-only micro-batches without sync: the tower ``b`` never runs (pytorch#194058)."""
    torch.manual_seed(0)
    model = Tower()
    fully_shard(model.b, mp_policy=MP)
    fully_shard(model, mp_policy=MP)
    for index in range(2):
        model.set_requires_gradient_sync(index == 1)
        model(micro_batch(rank, index)).float().pow(2).mean().backward()
    return "trains" if model.b.weight.grad is None and model.a.weight.grad is not None else "differs"


# witness row -> (what, the setting it is measured with)
WITNESSES = {
    "upcast master, no policy": "the plugin's fp32 master of a bf16 weight (accelerate's mixed_precision: \"no\")",
    "grad_dtype=fp32 before fully_shard": "a bf16 weight with grad_dtype=fp32 set before fully_shard (#170648)",
    "bf16 policy": "MixedPrecisionPolicy(bf16, bf16) (accelerate's mixed_precision: bf16)",
    "param_dtype-only policy": "MixedPrecisionPolicy(param_dtype=bf16)",
}


def outcome(fn, *args) -> str:
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return fn(*args)  # torch's assertion prints a stack
    except Exception as e:  # noqa: BLE001 - the outcome is the table
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"


def rank_main(rank: int, init_file: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    import contextlib
    import io

    rows = {}
    for case in CASES:
        torch_fsdp_ext.uninstall()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            without = run_case(case, rank)  # torch's assertion prints a stack
        torch_fsdp_ext.install()
        rows[case] = (without, run_case(case, rank))
    torch_fsdp_ext.uninstall()
    without = outcome(never_ran, rank)
    torch_fsdp_ext.install()
    rows["a unit that never ran forward, accumulation"] = (without, outcome(never_ran, rank))
    for case in WITNESSES:
        torch_fsdp_ext.uninstall()
        without = outcome(witness, case)
        torch_fsdp_ext.install()
        with_plugin = outcome(witness, case)
        with torch_fsdp_ext.installed(reduce_dtype="float32"):
            with_setting = outcome(witness, case)
        rows[case] = (without, with_plugin, with_setting)
    if rank == 0:
        out.update(rows)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(os.path.join(tmp, "init"), out), nprocs=WORLD_SIZE)
        rows = dict(out)
    print(f"torch {torch.__version__}, gloo on CPU, world size {WORLD_SIZE}")
    print("| case (upstream) | without the plugin | with the plugin |")
    print("|---|---|---|")
    for case, (_, thread) in CASES.items():
        without, with_plugin = rows[case]
        print(f"| {case} ({thread}) | {without} | {with_plugin} |")
    without, with_plugin = rows["a unit that never ran forward, accumulation"]
    print(f"| a unit that never ran forward, accumulation (#194058) | {without} | {with_plugin} |")
    print()
    print("Witness: a weight's gradient after micro-batches contributing 1.0 and 2**-10, the second synchronizing")
    print("| case | without the plugin | with the plugin | with TORCH_FSDP_EXT_REDUCE_DTYPE=float32 |")
    print("|---|---|---|---|")
    for case, what in WITNESSES.items():
        print(f"| {what} | {' | '.join(rows[case])} |")


if __name__ == "__main__":
    main()
