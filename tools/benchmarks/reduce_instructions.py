"""Instructions the reduce fix adds per group reduce, counted by callgrind.

    python tools/benchmarks/reduce_instructions.py

Counts 100 calls of ``foreach_reduce`` as ``FSDPParamGroup.post_backward`` calls it (positionally, the group's
orig dtype fp32, its reduce dtype fp32 or None) with a group of N fp32 gradients (one dtype: the path of every step without
accumulation), once through the fix's wrappers and once without, over a stand-in for torch's function that returns at
once, so that the difference is the wrappers' own work. Each count is ``torch.utils.benchmark.Timer(...)
.collect_callgrind()`` in a fresh ``python`` (``PYTHONHASHSEED=0``); the wrappers installed are those this torch needs.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.benchmark import Timer

SETUP = """
import torch
from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import _reduce as _compat_reduce
from torch_fsdp_ext._reduce import ReduceFix
positions = _compat_reduce.foreach_reduce_argument_positions()
def torch_reduce(*args, **kwargs):
    return None
fix = ReduceFix(_compat.load_internals())
reduce = torch_reduce
if {patched}:
    from torch_fsdp_ext._reduce._foreach_reduce import wrap_foreach_reduce
    needed = [part.needed()[0] for part in (fix.mixed_grad_dtypes, fix.frozen_first_forward)]
    fix.mixed_grad_dtypes.active = fix.frozen_first_forward.active = True
    reduce = wrap_foreach_reduce(fix.frozen_first_forward if needed[1] else None,
                                 fix.mixed_grad_dtypes if needed[0] else None, positions, reduce)
grads = [torch.zeros(4) for _ in range({n})]
args = [None] * (max(positions.values()) + 1)
args[positions["unsharded_grads"]] = grads
for name in ("orig_dtype", "reduce_dtype"):
    if name in positions:
        args[positions[name]] = torch.float32
args[positions["reduce_dtype"]] = {reduce_dtype}
args = tuple(args)
"""
STATEMENT = "for _ in range(100): reduce(*args)"


def count(patched: bool, n: int, reduce_dtype: str) -> int:
    timer = Timer(STATEMENT, setup=SETUP.format(patched=patched, n=n, reduce_dtype=reduce_dtype))
    return timer.collect_callgrind(number=1, collect_baseline=False).counts(denoise=True)


def main() -> None:
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = checkout + os.pathsep + os.environ.get("PYTHONPATH", "")
    print(f"torch {torch.__version__}")
    print("| reduce_dtype | gradients in the group | unpatched, per call | patched, per call | added per group reduce |")
    print("|---|---|---|---|---|")
    for reduce_dtype, n in (("torch.float32", 16), ("torch.float32", 256), ("None", 256)):
        plain, patched = count(False, n, reduce_dtype), count(True, n, reduce_dtype)
        print(f"| {reduce_dtype.removeprefix('torch.')} | {n} | {plain / 100:,.0f} | {patched / 100:,.0f} "
              f"| {(patched - plain) / 100:,.0f} |")


if __name__ == "__main__":
    main()
