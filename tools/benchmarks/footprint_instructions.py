"""What the plugin adds to code that is not FSDP2: an optimizer's construction and a non-reentrant checkpointed
forward + backward of a plain module, counted by callgrind, side by side with torch's own functions.

    python tools/benchmarks/footprint_instructions.py             # callgrind: 4 processes per operation, minutes
    python tools/benchmarks/footprint_instructions.py --calls     # no valgrind, seconds: the plugin's Python calls

Two moments of a process that imported the plugin (Note [Armed] in ``torch_fsdp_ext._install``):

- "no FSDP2": nothing was sharded yet; the plugin wrapped FSDP2's own functions only;
- "FSDP2 used": a ``fully_shard``-ed model (world 1, gloo) trained one step; from its ``fully_shard`` on, the
  plugin wraps ``Optimizer.add_param_group`` and the checkpoint hooks too.

"torch" is the same process with the plugin uninstalled right after its import (before the model is
sharded): its modules loaded and its probes run, torch's own functions everywhere. "added" is plugin minus
torch, per operation.

Note: how the counts are taken (as tools/bench_instructions.py takes them). Each count is one
``torch.utils.benchmark.Timer(...).collect_callgrind()`` process of its own, with ``PYTHONHASHSEED=0`` and
the cyclic garbage collector off while counting; the Timer's setup builds everything and runs the operation
a few times first, its statement runs it ``--number`` times. Where things lie in memory moves a count
(address-keyed hashing: a set of parameters, an optimizer's state dict), so each configuration is counted
at ``--shifts`` address shifts (the heap moved by a different amount in each process), and "added" is the
difference of the means next to the larger spread over the shifts.

``--calls`` counts, without valgrind, the Python calls of the plugin's own functions (``sys.setprofile``) in
one operation: what the instruction counts add up from.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from typing import Any

TOOL = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(TOOL)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import torch_fsdp_ext  # noqa: E402  (installs what this torch needs, as a training script's import does)
from torch_fsdp_ext._compat import fsdp2_api  # noqa: E402

OPERATIONS = ("optimizer", "checkpoint")
MOMENTS = ("no FSDP2", "FSDP2 used")
PLAN_ENV = "TORCH_FSDP_EXT_FOOTPRINT_PLAN"
SPEC_LENGTH = 200
WARMUP = 3
PLUGIN_DIR = os.path.dirname(torch_fsdp_ext.__file__)


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)))


class Plan:
    """One configuration, set up in the Timer's setup; ``run()`` is its statement."""

    def __init__(self, operation: str, moment: str, plugin: bool, number: int, address_shift: int = 0) -> None:
        if not plugin:
            torch_fsdp_ext.uninstall()
        self.number = number
        self.shifted = ([bytearray(8 * i + 8) for i in range(97 * address_shift)], torch.empty(1031 * address_shift))
        if moment == "FSDP2 used":
            if not dist.is_initialized():
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            api = fsdp2_api()
            torch.manual_seed(0)
            self.sharded = api.fully_shard(nn.Linear(32, 32), mp_policy=api.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16))
            sharded_optimizer = torch.optim.AdamW(self.sharded.parameters(), lr=1e-3)
            self.sharded(torch.randn(4, 32)).float().sum().backward()
            sharded_optimizer.step()
        self.model = plain_model()
        self.params = list(self.model.parameters())
        self.x = torch.randn(8, 32, requires_grad=True)
        self.operation = {"optimizer": self.construct_optimizer, "checkpoint": self.checkpointed_step}[operation]
        for _ in range(WARMUP):
            self.operation()
        # Note: automatic collection off: when it runs depends on every allocation since the last one.
        gc.disable()

    def construct_optimizer(self) -> None:
        torch.optim.AdamW(self.params, lr=1e-3)

    def checkpointed_step(self) -> None:
        checkpoint(self.model, self.x, use_reentrant=False).sum().backward()

    def run(self) -> None:
        for _ in range(self.number):
            self.operation()


def plan_from_env() -> Plan | None:
    """The configuration the driver passed; None outside valgrind (the Timer's own trial run)."""
    if "vgpreload" not in os.environ.get("LD_PRELOAD", ""):
        return None
    return Plan(**json.loads(os.environ[PLAN_ENV]))


def run_statement(plan: Plan | None) -> None:
    if plan is not None:
        plan.run()


def count_here(spec: dict) -> int:
    """Instructions of ``spec["number"]`` operations of one configuration: one callgrind process."""
    from torch.utils.benchmark import Timer

    # Note: padded to one length per shift: the environment sits on the counted process's stack.
    os.environ[PLAN_ENV] = json.dumps(spec).ljust(SPEC_LENGTH + 40 * spec["address_shift"])
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    timer = Timer(
        stmt="footprint_instructions.run_statement(plan)",
        setup=f"import sys; sys.path.insert(0, {os.path.dirname(TOOL)!r}); import footprint_instructions; "
        "plan = footprint_instructions.plan_from_env()",
    )
    stats = timer.collect_callgrind(number=1, repeats=1, collect_baseline=False)[0]
    return stats.counts(denoise=False)


def count(spec: dict) -> int:
    result = subprocess.run([sys.executable, TOOL, "--count-one", json.dumps(spec)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "0"})
    if result.returncode != 0:
        raise RuntimeError(f"counting {spec} failed:\n{result.stdout}{result.stderr}")
    return int(result.stdout.strip().splitlines()[-1])


def plugin_calls(operation: str, moment: str) -> dict[str, int]:
    """The plugin's own Python functions called by one operation (in this process; no valgrind)."""
    plan = Plan(operation, moment, plugin=True, number=1)
    gc.enable()
    calls: dict[str, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PLUGIN_DIR):
            name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
            calls[name] = calls.get(name, 0) + 1

    sys.setprofile(profile)
    try:
        plan.run()
    finally:
        sys.setprofile(None)
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", action="store_true", help="the plugin's Python calls per operation (no valgrind)")
    parser.add_argument("--number", type=int, default=20, help="operations per count (default 20)")
    parser.add_argument("--shifts", type=int, default=2, help="address shifts per configuration (default 2)")
    parser.add_argument("--operations", default=",".join(OPERATIONS), help="optimizer,checkpoint")
    parser.add_argument("--count-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_one:
        print(count_here(json.loads(args.count_one)))
        return 0
    operations = [op for op in args.operations.split(",") if op]
    print(f"torch {torch.__version__}; fixes active after import: {torch_fsdp_ext.install()}")
    if args.calls:
        # Note: "FSDP2 used" last: this process then has a sharded model, and the armed wrappers installed.
        for moment in MOMENTS:
            for operation in operations:
                calls = plugin_calls(operation, moment)
                listed = ", ".join(f"{name} {n}" for name, n in sorted(calls.items())) or "none"
                print(f"{moment:11} {operation:10} plugin calls: {sum(calls.values())} ({listed})")
        return 0
    print(f"instructions per operation ({args.number} per count, {args.shifts} address shift(s), PYTHONHASHSEED=0)")
    print(f"{'moment':11} {'operation':10} {'torch':>12} {'plugin':>12} {'added':>9} {'spread':>9}")
    for moment in MOMENTS:
        for operation in operations:
            per_op = {}
            for plugin in (False, True):
                counts = [count({"operation": operation, "moment": moment, "plugin": plugin, "number": args.number,
                                 "address_shift": shift}) / args.number for shift in range(args.shifts)]
                per_op[plugin] = counts
            spread = max(max(c) - min(c) for c in per_op.values())
            torch_mean, plugin_mean = statistics.mean(per_op[False]), statistics.mean(per_op[True])
            print(f"{moment:11} {operation:10} {torch_mean:12,.0f} {plugin_mean:12,.0f} "
                  f"{plugin_mean - torch_mean:9,.0f} {spread:9,.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
