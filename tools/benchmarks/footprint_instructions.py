"""What the plugin adds to code that is not FSDP2: an optimizer's construction and a non-reentrant checkpointed
forward + backward of a plain module, counted by callgrind, side by side with torch's own functions.

    python tools/benchmarks/footprint_instructions.py             # callgrind: 2 processes per shift, minutes
    python tools/benchmarks/footprint_instructions.py --calls     # no valgrind, seconds: the plugin's Python calls

Two moments of a process that imported the plugin (Note [Armed] in ``torch_fsdp_ext._install``):

- "no FSDP2": nothing was sharded yet; the plugin wrapped FSDP2's own functions only;
- "FSDP2 used": a ``fully_shard``-ed model (world 1, gloo) trained one step; from its ``fully_shard`` on, the
  plugin wraps ``Optimizer.add_param_group`` and the checkpoint hooks too.

"torch" is the same process with the plugin uninstalled (``uninstall()``: torch's own functions everywhere),
"plugin" with it installed again (``install()``), as the import installs it; "added" is plugin minus torch, per
operation.

Note: how the counts are taken. Where things lie in memory moves a count of one operation in different
processes by more than a thousand instructions (address-keyed hashing: a set of parameters, an optimizer's
state), and more than the plugin's wrappers cost. So torch and plugin are counted in one process, alternately
(``--rounds`` times each, each section ``--number`` operations after a warm-up), under callgrind with
``PYTHONHASHSEED=0`` and collection off at start: ``torch._C._valgrind_toggle`` (the switch
``Timer.collect_callgrind`` uses) counts a section and dumps it. The cyclic garbage collector is off while
counting (when it runs depends on every allocation since the last one), and torch runs one intra-op thread.
"torch" and "plugin" are the medians of their sections, "spread" the largest range of one configuration's
sections; ``--shifts`` repeats the whole in processes whose heap starts elsewhere.

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
WARMUP = 3
PLUGIN_DIR = os.path.dirname(torch_fsdp_ext.__file__)


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)))


class Operations:
    """The counted operations on a plain (not sharded) model."""

    def __init__(self) -> None:
        self.model = plain_model()
        self.params = list(self.model.parameters())
        self.x = torch.randn(8, 32, requires_grad=True)

    def optimizer(self) -> None:
        torch.optim.AdamW(self.params, lr=1e-3)

    def checkpoint(self) -> None:
        checkpoint(self.model, self.x, use_reentrant=False).sum().backward()


def use_fsdp2() -> nn.Module:
    """The first ``fully_shard`` of the process, and one training step of that model."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    api = fsdp2_api()
    torch.manual_seed(0)
    sharded = api.fully_shard(nn.Linear(32, 32), mp_policy=api.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    sharded(torch.randn(4, 32)).float().sum().backward()
    optimizer.step()
    return sharded


def sections(operations: list[str], rounds: int) -> list[tuple[str, int, str, str]]:
    """(moment, round, "torch" or "plugin", operation) of each counted section, in the order counted."""
    return [(moment, r, state, op) for moment in MOMENTS for r in range(rounds) for state in ("torch", "plugin")
            for op in operations]


def count_process(operations: list[str], number: int, rounds: int, address_shift: int) -> None:
    """Inside callgrind: each section of ``sections()`` counted and dumped on its own."""
    # Note: one intra-op thread. The instructions of pool threads that spin waiting for work are counted too,
    # and vary by millions between sections of one checkpointed forward + backward.
    torch.set_num_threads(1)
    shifted = ([bytearray(8 * i + 8) for i in range(97 * address_shift)], torch.empty(1031 * address_shift))
    ops = Operations()
    sharded = None
    for moment, _, state, operation in sections(operations, rounds):
        if moment == "FSDP2 used" and sharded is None:
            torch_fsdp_ext.install()
            sharded = use_fsdp2()
        if state == "torch":
            torch_fsdp_ext.uninstall()
        else:
            torch_fsdp_ext.install()
        run = getattr(ops, operation)
        for _ in range(WARMUP):
            run()
        gc.collect()
        gc.disable()
        torch._C._valgrind_toggle()
        for _ in range(number):
            run()
        torch._C._valgrind_toggle_and_dump_stats()
        gc.enable()
    del shifted, sharded


def count(operations: list[str], number: int, rounds: int, address_shift: int) -> list[int]:
    """One callgrind process: the instructions of each of ``sections()``, in order."""
    import tempfile

    expected = len(sections(operations, rounds))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        spec = json.dumps({"operations": operations, "number": number, "rounds": rounds,
                           "address_shift": address_shift})
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", PLAN_ENV: spec}
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}",
             sys.executable, TOOL, "--count-process"], capture_output=True, text=True, env=env,
        )
        if result.returncode != 0:
            raise RuntimeError(f"counting {spec} failed:\n{result.stdout}{result.stderr[-3000:]}")
        # Each dump is a file of its own, numbered from 1; the one at exit (nothing collected since) comes last.
        dumps = sorted((int(name.rsplit(".", 1)[1]), name) for name in os.listdir(tmp)
                       if name.rsplit(".", 1)[-1].isdigit())[:expected]
        if len(dumps) != expected:
            raise RuntimeError(f"counting {spec}: expected one dump per section, found {os.listdir(tmp)}")
        counts = []
        for _, name in dumps:
            with open(os.path.join(tmp, name), encoding="utf-8") as f:
                totals = [line for line in f if line.startswith(("summary:", "totals:"))]
            counts.append(int(totals[-1].split()[1]))
        return counts


def plugin_calls(operations: list[str]) -> dict[tuple[str, str], dict[str, int]]:
    """The plugin's own Python functions that one operation calls, per moment (in this process; no valgrind)."""
    ops = Operations()
    found = {}
    for moment in MOMENTS:
        if moment == "FSDP2 used":
            use_fsdp2()
        for operation in operations:
            run = getattr(ops, operation)
            run()  # warm-up, as counted
            calls: dict[str, int] = {}

            def profile(frame: Any, event: str, arg: Any) -> None:
                if event == "call" and frame.f_code.co_filename.startswith(PLUGIN_DIR):
                    name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                    calls[name] = calls.get(name, 0) + 1

            sys.setprofile(profile)
            try:
                run()
            finally:
                sys.setprofile(None)
            found[moment, operation] = calls
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", action="store_true", help="the plugin's Python calls per operation (no valgrind)")
    parser.add_argument("--number", type=int, default=20, help="operations per count (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="sections of each configuration per process (default 3)")
    parser.add_argument("--shifts", type=int, default=1, help="processes, each with its heap elsewhere (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind processes at a time (default 2)")
    parser.add_argument("--operations", default=",".join(OPERATIONS), help="optimizer,checkpoint")
    parser.add_argument("--count-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_process:
        count_process(**json.loads(os.environ[PLAN_ENV]))
        return 0
    operations = [op for op in args.operations.split(",") if op]
    print(f"torch {torch.__version__}; fixes active after import: {torch_fsdp_ext.install()}")
    if args.calls:
        for (moment, operation), calls in plugin_calls(operations).items():
            listed = ", ".join(f"{name} {n}" for name, n in sorted(calls.items())) or "none"
            print(f"{moment:11} {operation:10} plugin calls: {sum(calls.values())} ({listed})")
        return 0
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        counted = list(pool.map(lambda shift: count(operations, args.number, args.rounds, shift), range(args.shifts)))
    per_op: dict[tuple[str, str, str], list[float]] = {}
    for counts in counted:
        for (moment, _, state, operation), n in zip(sections(operations, args.rounds), counts):
            per_op.setdefault((moment, state, operation), []).append(n / args.number)
    print(f"instructions per operation ({args.number} per section, {args.rounds} sections of each, "
          f"{args.shifts} process(es), PYTHONHASHSEED=0)")
    print(f"{'moment':11} {'operation':10} {'torch':>12} {'plugin':>12} {'added':>9} {'spread':>9}")
    for moment in MOMENTS:
        for operation in operations:
            of = {state: per_op[moment, state, operation] for state in ("torch", "plugin")}
            spread = max(max(c) - min(c) for c in of.values())
            # Note: medians: a process's first section of a configuration may still pay for warming up.
            torch_mean, plugin_mean = statistics.median(of["torch"]), statistics.median(of["plugin"])
            print(f"{moment:11} {operation:10} {torch_mean:12,.0f} {plugin_mean:12,.0f} "
                  f"{plugin_mean - torch_mean:9,.0f} {spread:9,.0f}")
    print("each section (per operation), in the order counted:")
    for (moment, state, operation), counts in per_op.items():
        print(f"  {moment:11} {operation:10} {state:6} {' '.join(f'{c:,.0f}' for c in counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
