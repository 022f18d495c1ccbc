"""``python -m torch_fsdp_ext doctor``: what this torch needs, what is active, and a live self-test.

The self-test runs a seed scenario per fix (``shared/seeds``) on real ranks, once
without and once with the plugin, and checks the patched result, not just the
absence of an exception.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _compat
from ._dtype._plan import MixedParamDtypeError
from ._failures import FAILURES
from ._install import FIX_NAMES, install, status, uninstall
from ._local_ranks import run_local_ranks, write_result
from ._rank_end import end_rank
from ._report import NEEDED_LEGEND, format_table, needed_word, plugin_does, repaired_by


@dataclass
class Backend:
    name: str  # "gloo" or "nccl"
    device_type: str
    world_size: int


def choose_backend(world_size: int) -> Backend:
    if torch.cuda.is_available() and dist.is_nccl_available():
        # NCCL refuses several ranks on one GPU.
        return Backend("nccl", "cuda", min(world_size, torch.cuda.device_count()))
    return Backend("gloo", "cpu", world_size)


# -- scenarios (run on every rank) -------------------------------------------------


def _mixed_dtype_scenario(device: torch.device, strategy: str) -> None:
    """Seed 000: bf16 linear with an fp32 norm in one group, bf16 compute, one optimizer step.

    Checks the result of the active strategy: fp32 masters that an lr=1e-6 step moves
    (upcast), every parameter and gradient in its loaded dtype (preserve), or the
    error that names the parameters (error).
    """
    fully_shard, MixedPrecisionPolicy = _compat.fsdp2_api().fully_shard, _compat.fsdp2_api().MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).to(device)
    model[0].to(torch.bfloat16)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6 if strategy == "upcast" else 1e-2)
    before = model[0].weight.full_tensor().clone()
    try:
        model(torch.randn(4, 16, device=device)).float().pow(2).sum().backward()
    except MixedParamDtypeError:
        if strategy == "error":
            return  # the configured outcome
        raise
    optimizer.step()
    if strategy == "error":
        raise ValueError("wrong result: dtype_strategy='error' let a mixed group train")
    expected = {torch.float32} if strategy == "upcast" else {torch.bfloat16, torch.float32}
    if {p.dtype for p in model.parameters()} != expected:
        raise ValueError(f"wrong result: parameter dtypes are not {sorted(map(str, expected))}")
    if any(p.grad.dtype != p.dtype for p in model.parameters()):
        raise ValueError("wrong result: a gradient's dtype differs from its parameter's")
    if torch.equal(before, model[0].weight.full_tensor()):
        raise ValueError("wrong result: an optimizer step did not change the weights")


class _SeedModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear1(nn.functional.gelu(x))


def _recompute_scenario(device: torch.device, strategy: str) -> None:
    """Seed 004: checkpoint(fully_shard module) under autocast; grads must match no checkpoint."""
    from torch.utils.checkpoint import checkpoint

    fully_shard, MixedPrecisionPolicy = _compat.fsdp2_api().fully_shard, _compat.fsdp2_api().MixedPrecisionPolicy

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = _SeedModule().to(device)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
        x = torch.randn(8, 64, device=device, requires_grad=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            out = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
            out.float().sum().backward()
        grads.append(x.grad)
    if not torch.equal(grads[0], grads[1]):
        raise ValueError("wrong result: gradients differ from the run without checkpointing")


class _BranchModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _reduce_scenario(device: torch.device, strategy: str) -> None:
    """pytorch#196996: accumulation without sync, ``b`` used first on the synchronizing micro-batch; the reduced
    gradients must be what a bf16 copy's gradients give, cast to fp32, accumulated and averaged over the ranks."""
    import copy

    fully_shard, MixedPrecisionPolicy = _compat.fsdp2_api().fully_shard, _compat.fsdp2_api().MixedPrecisionPolicy

    torch.manual_seed(0)
    model = _BranchModule().to(device)
    compute = copy.deepcopy(model).to(torch.bfloat16)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    expected: dict[str, torch.Tensor] = {}
    for index, use_b in enumerate((False, True)):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * index + dist.get_rank())).to(device)
        compute.zero_grad(set_to_none=True)
        compute(x.to(torch.bfloat16), use_b).float().pow(2).mean().backward()
        for name, param in compute.named_parameters():
            if param.grad is not None:
                expected[name] = expected.get(name, 0) + param.grad.float()
        model.set_requires_gradient_sync(index == 1)
        model(x, use_b).float().pow(2).mean().backward()
    for name, param in model.named_parameters():
        dist.all_reduce(expected[name])
        if not torch.equal(param.grad.full_tensor(), expected[name] / dist.get_world_size()):
            raise ValueError(f"wrong result: the reduced gradient of {name} differs from the fp32 reference")


def _baseline_scenario(device: torch.device) -> None:
    """Plain FSDP2 with nothing to fix: if this fails, FSDP2 itself cannot run here."""
    model = _compat.fsdp2_api().fully_shard(nn.Linear(4, 4).to(device))
    model(torch.randn(2, 4, device=device)).sum().backward()


SCENARIOS = {"dtype": _mixed_dtype_scenario, "recompute": _recompute_scenario, "reduce": _reduce_scenario}


def _outcome(fn, device: torch.device, strategy: str) -> str:
    try:
        fn(device, strategy)
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        message = str(e).splitlines()[0] if str(e) else ""
        return "wrong result" if message.startswith("wrong result") else type(e).__name__
    return "ok"


def _rank_main(rank: int, init_file: str, result_file: str, backend: Backend, strategy: str) -> None:
    device = torch.device(backend.device_type, rank) if backend.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend.name, init_method=f"file://{init_file}", rank=rank, world_size=backend.world_size)
    # The scenarios upcast on purpose: the cost warning meant for training runs is noise in this report.
    logging.getLogger("torch_fsdp_ext").setLevel(logging.ERROR)
    results = {}
    try:
        uninstall()
        try:
            _baseline_scenario(device)
        except Exception as e:  # noqa: BLE001
            results["baseline"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for name, fn in SCENARIOS.items():
            if "baseline" in results:
                break
            uninstall()
            # Note: torch's own assertion prints a stack to stderr (``_raise_assert_with_print``); the table says it.
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), \
                    contextlib.redirect_stderr(devnull):
                without = _outcome(fn, device, strategy)
            install(dtype_strategy=strategy)
            results[name] = {"without": without, "with": _outcome(fn, device, strategy)}
    except Exception:  # noqa: BLE001
        results["error"] = traceback.format_exc()
    if rank == 0:
        write_result(result_file, results)
    end_rank(wait_for_peers="error" not in results)


def run_self_test(backend: Backend, strategy: str, timeout: float = 120.0) -> dict:
    return run_local_ranks(_rank_main, (backend, strategy), backend.world_size, timeout)


# -- report --------------------------------------------------------------------------


def describe(outcome: dict) -> tuple[str, bool]:
    """One table cell, e.g. 'AssertionError → fixed', and whether the plugin's run passed."""
    without, with_plugin = outcome["without"], outcome["with"]
    before = "no failure" if without == "ok" else without
    if with_plugin == "ok":
        after = "fixed" if without != "ok" else "runs"
    else:
        after = f"still fails: {with_plugin}"
    return f"{before} → {after}", with_plugin == "ok"


def fix_rows(report, outcomes: dict) -> tuple[list[list[str]], bool]:
    rows = [["fix", "needed", "active", "seed scenario: without → with plugin", "plugin does"]]
    healthy = True
    for name in FIX_NAMES:
        fix = report.fixes[name]
        if name in outcomes:
            cell, passed = describe(outcomes[name])
            healthy &= passed or not fix.needed
        else:
            cell = "not run"
        rows.append([name, needed_word(fix), "yes" if fix.active else "no", cell, plugin_does(fix)])
    return rows, healthy


def legend(report, outcomes: dict) -> list[str]:
    """What the table's words mean, from the table's own rows.

    Note: "partly" is one word for several cases: on 2.13 torch replays the part of the recompute failure
    that the seed scenario exercises (it runs without the plugin), on 2.14 torch fixes one part of the
    reduce failure and the seed scenario exercises another (it fails without the plugin). Each partly row
    gets its own line, saying which parts torch repairs and what that leaves the seed scenario.
    """
    lines = [
        NEEDED_LEGEND,
        "fixes: " + "; ".join(f"{name} = {failure}" for name, failure in FAILURES.items()),
        "seed scenario: the reported failure, run on real ranks without and then with the plugin; "
        "'fixed' and 'runs': the result was checked",
    ]
    for name in FIX_NAMES:
        fix = report.fixes[name]
        if needed_word(fix) != "partly":
            continue
        ours, torch_own = repaired_by(fix)
        line = f"{name} partly: torch repairs {', '.join(torch_own)}; the plugin {', '.join(ours)}"
        outcome = outcomes.get(name)
        if isinstance(outcome, dict):
            line += ("; so the seed scenario runs without the plugin too" if outcome["without"] == "ok"
                     else "; the seed scenario needs the plugin's part")
        lines.append(line)
    return lines


def doctor(world_size: int = 2) -> int:
    report = status()
    internals = _compat.load_internals()
    backend = choose_backend(world_size)
    print("torch_fsdp_ext doctor")
    print(f"torch {torch.__version__}; FSDP2 at {internals.fsdp_package or 'not found'}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(
        f"backends: gloo {'yes' if dist.is_gloo_available() else 'no'}, nccl "
        f"{'yes' if dist.is_nccl_available() else 'no'}, cuda {'yes' if gpus else 'no'} ({gpus} GPUs)"
    )
    if not report.supported:
        print("Unsupported torch: " + "; ".join(report.missing) + ".")
        print("The plugin patches nothing here; torch behaves as without it.")
        return 0
    print("Every rank must run the plugin: where one does not, the others stop at their first forward")
    print("with a RankCheckTimeoutError once the process group's timeout has passed.")
    strategy = report.fixes["dtype"].details.get("strategy", "upcast")
    print(f"self-test: {backend.world_size} rank(s), {backend.name} on {backend.device_type}; dtype strategy {strategy!r}")
    outcomes = run_self_test(backend, strategy)
    if "error" in outcomes:
        print(f"self-test could not run:\n{outcomes['error']}")
        return 1
    if "baseline" in outcomes:
        print(f"self-test not run: FSDP2 itself fails on {backend.device_type} with this torch ({outcomes['baseline']})")
    rows, healthy = fix_rows(report, outcomes)
    print(format_table(rows))
    print("\n".join(legend(report, outcomes)))
    return 0 if healthy else 1
