"""What the plugin's optimizer step pre-hook costs, in instructions (callgrind), beside the step it runs before.

    python tools/benchmarks/optimizer_hook_cost.py             # 10k and 100k parameters; exit 1 if a bound is missed
    python tools/benchmarks/optimizer_hook_cost.py --quick     # 1k and 10k parameters

The hook checks parameters the plugin upcast for optimizer state older than the upcast
(``torch_fsdp_ext/_dtype/_optimizer_state.py``). Per optimizer size, instructions of one hook
call with one upcast parameter still to check that this optimizer does not hold (the
worst case: it stays pending for good) and with nothing pending, against one
``optimizer.step()`` without the hook (SGD over one-element parameters: the cheapest
step torch makes).
Bounds: with one parameter pending the hook's count does not grow with the optimizer's
parameters (largest size <= 1.2 x smallest) and is under 1% of the step; with nothing
pending, under 0.1% of the step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import torch
from torch.utils.benchmark import Timer

BOUND_GROWTH = 1.2
BOUND_PENDING_SHARE = 0.01
BOUND_NONE_PENDING_SHARE = 0.001

SETUP = """
import os
os.environ["TORCH_FSDP_EXT_DISABLE"] = "1"
import torch
from torch_fsdp_ext._dtype import _optimizer_state

class StandInFSDPParam:
    def __init__(self):
        self.sharded_param = torch.nn.Parameter(torch.zeros(1))

params = [torch.nn.Parameter(torch.zeros(1)) for _ in range({count})]
for p in params:
    p.grad = torch.ones(1)
optimizer = torch.optim.SGD(params, lr=1e-3, foreach=True)
outside = StandInFSDPParam()  # held by no optimizer
if {pending}:
    _optimizer_state.remember_upcast(outside, torch.bfloat16)
hook = _optimizer_state._check_before_step
hook(optimizer, (), {{}})  # the first pending check collects the optimizer's parameter ids
"""


def instructions(stmt: str, count: int, pending: bool) -> int:
    timer = Timer(stmt=stmt, setup=SETUP.format(count=count, pending=pending))
    stats = timer.collect_callgrind(number=3, collect_baseline=False)
    return stats.counts(denoise=True) // 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing measured")
        return 1
    sizes = (1_000, 10_000) if args.quick else (10_000, 100_000)
    print(f"torch {torch.__version__}; instructions per call (callgrind, denoised, mean of 3)")
    print(f"{'parameters':>10}  {'optimizer.step(), no hook':>26}{'hook, 1 pending':>18}{'hook, none pending':>20}")
    rows = {}
    for count in sizes:
        step = instructions("optimizer.step()", count, pending=False)
        pending = instructions("hook(optimizer, (), {})", count, pending=True)
        none = instructions("hook(optimizer, (), {})", count, pending=False)
        rows[count] = (step, pending, none)
        print(f"{count:>10,}  {step:>26,}{pending:>18,}{none:>20,}")
    small, large = rows[sizes[0]], rows[sizes[-1]]
    growth = large[1] / small[1]
    checks = {
        f"1 pending: {sizes[-1]:,} / {sizes[0]:,} parameters = {growth:.2f} <= {BOUND_GROWTH}": growth <= BOUND_GROWTH,
        f"1 pending: share of the step <= {BOUND_PENDING_SHARE:.0%} at every size": all(
            p / s <= BOUND_PENDING_SHARE for s, p, _ in rows.values()),
        f"none pending: share of the step <= {BOUND_NONE_PENDING_SHARE:.1%} at every size": all(
            n / s <= BOUND_NONE_PENDING_SHARE for s, _, n in rows.values()),
    }
    for check, held in checks.items():
        print(f"bound: {check}: {'ok' if held else 'MISSED'}")
    ok = all(checks.values())
    print(json.dumps({"bounds held": ok}))
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
