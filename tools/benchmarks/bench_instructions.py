"""Instructions the plugin adds per FSDP forward, counted by callgrind: deterministic where time is not.

    python tools/benchmarks/bench_instructions.py                 # world 1 and 2, no / per-block checkpoint, 2 address
                                                                  # shifts, mixed model, per-wrapper breakdown; exit 1
                                                                  # on a missed bound
    python tools/benchmarks/bench_instructions.py --world 1 --no-aa --no-breakdown --no-mixed
                                                                  # the four counts of world 1
    python tools/benchmarks/bench_instructions.py --functions 25  # also the C functions whose counts the plugin changes
                                                                  # most
    python tools/benchmarks/bench_instructions.py --quick         # CI form: world 1, no checkpoint, 2 steps, 3 shifts;
                                                                  # bound
    python tools/benchmarks/bench_instructions.py --quick --reduce-dtype float32
                                                                  # the same with reduce_dtype=fp32
    python tools/benchmarks/bench_instructions.py --bytecodes     # no valgrind, seconds: the plugin's Python bytecodes
                                                                  # per step
    python tools/benchmarks/bench_instructions.py --layout roots  # each checkpointed block is called directly, its own
                                                                  # root
    python tools/benchmarks/bench_instructions.py --layout direct --world 1 --no-mixed
                                                                  # the same under a sharded Stack that never runs (each
                                                                  # block its own root), with its breakdown

Each count is ``torch.utils.benchmark.Timer(...).collect_callgrind()`` of 10 training steps (forward,
``.sum().backward()``) of a stack of 8 blocks (``Linear(32, 32)``), each ``fully_shard``-ed, plus the root,
``param_dtype=bf16`` (``--layout roots``: no root ``fully_shard``, so each block is an iteration root and
claims, moves and releases it in every forward and recompute; ``--layout direct``: the ``Stack`` is
``fully_shard``-ed too but never called, the step calls each block itself, so each block is its own root
under a sharded parent). "added per FSDP forward" is the plugin's added count divided by the blocks' forwards
(8 per step, and 8 recomputes more with per-block checkpointing); the root's forward is in the total.

Note: how the counts are taken. Callgrind re-imports torch in a fresh ``python``
from PATH (this interpreter's directory is put first) and instruments everything,
so a count takes minutes. Each configuration is counted in a callgrind process of
its own with ``PYTHONHASHSEED=0`` (``--jobs`` at a time): the Timer's setup builds
the model, sets the plugin's state and warms up, its statement runs the counted
steps. Counted within one process one after the other, configurations differ by
~250k instructions per step in 18 M (allocator state, address-keyed hashing),
more than the plugin adds. Fresh processes of one build repeat to about a thousand
per step, but where things lie in memory moves a count by tens of thousands: builds
that differ in no code a step runs differed by that much. So unpatched and patched
are each counted at several address shifts (2; ``--quick`` 3; ``--no-aa`` 1): the
heap and stack moved by a different amount in each process. "Added" compares their
means, and a bound is missed when the plugin adds more than it beyond the larger
spread of one configuration over the shifts.

Note: world size 2 runs on torch's fake process group (collectives move no data):
FSDP shards as on two ranks and the plugin's per-forward paths are the same as on
a real group (none of them talks to the other ranks after the first forward),
while counts stay exact. Gloo's own work for real collectives is torch's, the
same with and without the plugin.

Note: the breakdown bypasses one group of the plugin's wrappers at a time (the
torch original is put back for that configuration only) and reports what the
plugin then adds less: the instructions that wrapper group costs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)

from bench_cpu import Stack, step, table  # noqa: E402 (also sets TORCH_FSDP_EXT_DISABLE: we install explicitly)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import torch_fsdp_ext  # noqa: E402
from torch_fsdp_ext import _install, _patching  # noqa: E402
from torch_fsdp_ext._compat import fsdp2_api  # noqa: E402

BLOCKS = 8
STEPS = 10
WARMUP_STEPS = 3
# 2.13.0, world size 1: at most half of what the plugin added before this tool existed (7,320 and 33,616).
BOUND_PER_FORWARD = {False: 3_500, True: 16_000}
PLAN_ENV = "TORCH_FSDP_EXT_INSTRUCTION_PLAN"
# Blocks under a sharded root; each block its own root; each its own root under a sharded Stack that never runs.
LAYOUTS = ("stack", "roots", "direct")
layout = "stack"  # of the configurations main() counts
reduce_dtype: str | None = None  # the policy's reduce_dtype, a torch dtype's name (--reduce-dtype)
SPEC_LENGTH = 512

# Wrapper groups the breakdown bypasses one at a time: (fix, torch attributes it wraps).
WRAPPER_GROUPS = {
    "FSDPState._lazy_init (rank check)": ("dtype", {"_lazy_init"}),
    "FSDPState._pre_forward/_post_forward": ("recompute", {"_pre_forward", "_post_forward"}),
    "checkpoint hooks __init__/__enter__/__exit__": ("recompute", {"__init__", "__enter__", "__exit__"}),
}


# -- what runs inside the callgrind process ------------------------------------------


def valgrind_toggle() -> None:
    """Switch callgrind's collection on or off (a no-op outside valgrind)."""
    torch._C._valgrind_toggle()


def under_valgrind() -> bool:
    return "vgpreload" in os.environ.get("LD_PRELOAD", "")


class Bypass:
    """Put torch's originals back for one wrapper group (the plugin stays installed otherwise).

    FSDP's pre/post-forward wrappers are either class attributes or, where torch's
    decorator calls the method through a closure cell, switched into that cell during
    checkpoint regions: bypassing them there makes the switch put torch's method in.
    """

    def __init__(self, group: str | None) -> None:
        self.swapped: list[tuple[Any, str, Any]] = []
        self.switched: list[tuple[list, Any]] = []
        if group is None:
            return
        fix_name, names = WRAPPER_GROUPS[group]
        fix, patches = _install._active[fix_name]
        for patch in patches._attributes:
            if patch.name in names:
                self.swapped.append((patch.owner, patch.name, patch.owner.__dict__[patch.name]))
                if patch.original is _patching._ABSENT:  # torch's own was inherited
                    delattr(patch.owner, patch.name)
                else:
                    setattr(patch.owner, patch.name, patch.original)
        if fix_name == "recompute" and "_pre_forward" in names:
            for entry in fix.switch.cells:  # [cell, torch's method, wrapper]
                self.switched.append((entry, entry[2]))
                entry[2] = entry[1]

    def undo(self) -> None:
        for owner, name, wrapper in self.swapped:
            setattr(owner, name, wrapper)
        for entry, wrapper in self.switched:
            entry[2] = wrapper


def build(config: dict) -> torch.nn.Module:
    """The configuration's model, sharded with the plugin in the state named by ``config["built"]``."""
    api = fsdp2_api()
    reduce = config.get("reduce_dtype")
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce) if reduce else None)
    switch(config["built"])
    torch.manual_seed(0)
    model = Stack(BLOCKS, checkpointed=config["checkpoint"])
    if config["model"] == "mixed":  # bf16 weights, fp32 biases: every group is mixed
        model.to(torch.bfloat16)
        for block in model.blocks:
            block.lin.bias.data = block.lin.bias.data.float()
    elif config["model"] == "mixed, model.float()":  # the workaround without the plugin
        model.to(torch.bfloat16).float()
    for block in model.blocks:
        api.fully_shard(block, mp_policy=policy)
    if config.get("layout", "stack") in ("stack", "direct"):
        api.fully_shard(model, mp_policy=policy)
    return model


def run_step(model: torch.nn.Module, x: torch.Tensor, layout_of_model: str) -> None:
    """One training step; in the ``direct`` layout the step calls the blocks itself, not the sharded ``Stack``."""
    if layout_of_model != "direct":
        step(model, x)
        return
    h = x
    for block in model.blocks:
        h = checkpoint(block, h, use_reentrant=False) if model.checkpointed else block(h)
    h.float().sum().backward()


def switch(plugin: str | None, bypass: str | None = None) -> Bypass:
    """Install the plugin with this dtype strategy (None: uninstall it), one wrapper group bypassed."""
    torch_fsdp_ext.uninstall()
    if plugin is None:
        return Bypass(None)
    torch_fsdp_ext.install(dtype_strategy=plugin)
    bypassed = Bypass(bypass)
    if bypass is not None:
        fix, patches = _install._active["recompute"]
        if not fix.switches_hooks:
            fix.rebind_existing_hooks(patches)  # hooks bound to a bypassed wrapper go back to torch's own
    return bypassed


class Plan:
    """One configuration, built and warmed up in the Timer's setup; ``run()`` (the Timer's statement) counts its steps."""

    def __init__(self, config: dict, world: int, steps: int, address_shift: int) -> None:
        self.steps = steps
        self.layout = config.get("layout", "stack")
        if world == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        self.x = torch.randn(8, 32)
        # Note: every process, unpatched ones too, installs and uninstalls the plugin once first. install()
        # runs the plugin's probes (a tiny FSDP group, a tiny checkpoint): torch code they run is warmed and
        # the allocator left as they leave it in both, so a count differs only by what is installed during
        # the steps. Without this, the same plugin measured -599 to +8,221 per forward across builds that
        # differed only in code no step runs.
        torch_fsdp_ext.install()
        torch_fsdp_ext.uninstall()
        # Note: the address shift (with the environment's length in count_here) moves the heap and the stack
        # under everything built from here on. Address-keyed hashing and alignment make a count depend on
        # where things lie: builds of the package that differ in no code a step runs measured -3,723 to +5,914
        # per forward, while repeats of one build differed by at most 1,060 per step. Counting each
        # configuration at several shifts samples that spread within one build.
        self.shifted = ([bytearray(8 * i + 8) for i in range(97 * address_shift)], torch.empty(1031 * address_shift))
        self.model = build(config)
        self.bypass = switch(config["plugin"], config["bypass"])
        for _ in range(WARMUP_STEPS):  # lazy init, rank check, caches
            run_step(self.model, self.x, self.layout)
        # Note: automatic garbage collection off while counting. When a collection runs
        # depends on every allocation since the last one, so it falls into one count's
        # steps and not the other's: tens of thousands of instructions of noise.
        gc.disable()

    @classmethod
    def from_env(cls) -> Plan | None:
        """The configuration passed by the driver; None outside valgrind (the Timer's own trial run)."""
        if not under_valgrind():
            return None
        spec = json.loads(os.environ[PLAN_ENV])
        return cls(spec["config"], spec["world"], spec["steps"], spec["address_shift"])

    def run(self) -> None:
        for _ in range(self.steps):
            run_step(self.model, self.x, self.layout)


def run_statement(plan: Plan | None) -> None:
    if plan is not None:
        plan.run()


# -- the driver ----------------------------------------------------------------------


def count_here(spec: dict) -> dict:
    """Instructions of ``spec["steps"]`` steps of one configuration, in total and per function (exclusive):
    one callgrind process (called in a worker)."""
    from torch.utils.benchmark import Timer

    # Note: padded to one length per address shift. The environment sits on the stack of the
    # counted process: a longer one shifts every stack address, and counts with it (~0.4 %
    # between configurations whose specs differ by a few characters, more than the plugin adds).
    os.environ[PLAN_ENV] = json.dumps(spec).ljust(SPEC_LENGTH + 40 * spec["address_shift"])
    os.environ["PYTHONHASHSEED"] = "0"
    # collect_callgrind starts ``python`` from PATH: make it this interpreter (and its venv).
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    timer = Timer(
        stmt="bench_instructions.run_statement(plan)",
        setup=f"import sys; sys.path.insert(0, {TOOLS_DIR!r}); import bench_instructions; "
        "plan = bench_instructions.Plan.from_env()",
    )
    stats = timer.collect_callgrind(number=1, repeats=1, collect_baseline=False)[0]
    functions = stats.as_standardized().stats(inclusive=False)
    return {"total": stats.counts(denoise=False), "functions": [[f.count, f.function] for f in functions]}


def count(runs: list[tuple[dict, int]], world: int, steps: int, jobs: int) -> list[dict]:
    """Instructions of ``steps`` steps of each (configuration, address shift), each from a callgrind process of
    its own.

    One process per count: see the module's Note on how the counts are taken.
    """
    specs = [{"config": c, "world": world, "steps": steps, "address_shift": shift} for c, shift in runs]

    def one(spec: dict) -> dict:
        result = subprocess.run([sys.executable, __file__, "--count-one", json.dumps(spec)],
                                capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        if result.returncode != 0:
            raise RuntimeError(f"counting {spec} failed:\n{result.stdout}{result.stderr}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, specs))


def config(checkpoint: bool, plugin: str | None, model: str = "plain", bypass: str | None = None,
           built: str | None = None) -> dict:
    """What one count runs: ``model`` sharded with the plugin in state ``built``, run in state ``plugin``."""
    return {"checkpoint": checkpoint, "plugin": plugin, "model": model, "bypass": bypass, "built": built,
            "layout": layout, "reduce_dtype": reduce_dtype}


def forwards_per_step(checkpoint: bool) -> int:
    return BLOCKS * (2 if checkpoint else 1)


def count_bytecodes(checkpoint: bool) -> dict[str, tuple[int, int]]:
    """Per plugin function: (bytecodes executed, calls) in one patched step, in this process (no valgrind)."""
    plugin_dir = os.path.dirname(torch_fsdp_ext.__file__)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build(config(checkpoint, None))
    switch("upcast")
    x = torch.randn(8, 32)
    for _ in range(WARMUP_STEPS):
        run_step(model, x, layout)
    counts: dict[str, list[int]] = {}

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(plugin_dir):
            return None
        frame.f_trace_opcodes = True
        entry = counts.setdefault(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}", [0, 0])
        entry[1] += 1

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                entry[0] += 1
            return local

        return local

    sys.settrace(trace)
    try:
        run_step(model, x, layout)
    finally:
        sys.settrace(None)
        torch_fsdp_ext.uninstall()
        dist.destroy_process_group()
    return {name: (ops, calls) for name, (ops, calls) in counts.items()}


def function_table(unpatched: list, patched: list, steps: int, top: int) -> str:
    """The ``top`` functions by |patched - unpatched| exclusive instructions per step."""
    delta: dict[str, int] = {}
    for sign, functions in ((-1, unpatched), (1, patched)):
        for n, name in functions:
            delta[name] = delta.get(name, 0) + sign * n
    largest = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]
    return table(["function", "added per step"], [[name[-100:], f"{n / steps:+,.0f}"] for name, n in largest])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, choices=[1, 2], action="append", help="world size(s); default 1 and 2")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-wrapper breakdown")
    parser.add_argument("--no-mixed", action="store_true", help="skip preserve/upcast on the mixed-dtype model")
    parser.add_argument("--no-aa", action="store_true",
                        help="count unpatched and patched once each (no control: the plain difference)")
    parser.add_argument("--quick", action="store_true",
                        help="CI: world 1, no checkpoint, 2 steps, unpatched and patched at 3 address shifts each")
    parser.add_argument("--functions", type=int, default=0, metavar="N",
                        help="also print the N functions whose instructions the plugin changes most (callgrind)")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind processes at a time (default 2)")
    parser.add_argument("--checkpointed-only", action="store_true",
                        help="count the per-block checkpoint configurations only (half the processes)")
    parser.add_argument("--count-one", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--bytecodes", action="store_true", help="count the plugin's Python bytecodes (no valgrind)")
    parser.add_argument("--layout", choices=LAYOUTS, default="stack",
                        help="stack: blocks under a sharded root (default); roots: each block its own root; direct: "
                        "each block its own root, called by the step, under a sharded Stack that never runs")
    parser.add_argument("--reduce-dtype", choices=["float32"],
                        help="the policy's reduce_dtype (default: none, FSDP reduces in param_dtype); with float32 the "
                        "reduce fix, where installed, reads each gradient's dtype in every group reduce")
    args = parser.parse_args()
    global layout, reduce_dtype
    layout, reduce_dtype = args.layout, args.reduce_dtype
    if args.bytecodes:
        print(f"torch {torch.__version__}: the plugin's Python bytecodes in one step, {BLOCKS} blocks, world size 1, "
              f"layout {layout}")
        for checkpoint in (False, True):
            counts = count_bytecodes(checkpoint)
            rows = [[name, f"{ops:,}", str(calls)] for name, (ops, calls) in sorted(counts.items(), key=lambda kv: -kv[1][0])]
            rows.append(["total", f"{sum(o for o, _ in counts.values()):,}", str(sum(c for _, c in counts.values()))])
            print(f"\n{'per-block checkpoint' if checkpoint else 'no checkpoint'}")
            print(table(["function", "bytecodes", "calls"], rows))
        return 0
    if args.count_one:
        print(json.dumps(count_here(json.loads(args.count_one))))
        return 0
    worlds = [1] if args.quick else (args.world or [1, 2])
    steps = 2 if args.quick else STEPS
    needed = {name: torch_fsdp_ext.status().fixes[name].needed for name in torch_fsdp_ext.FIX_NAMES}
    print(f"torch {torch.__version__}, torch_fsdp_ext {torch_fsdp_ext.__version__}, python {sys.version.split()[0]}, "
          f"PYTHONHASHSEED=0, {time.strftime('%Y-%m-%d', time.gmtime())}; fixes this torch needs: "
          + ", ".join(name for name, n in needed.items() if n))
    print(f"{BLOCKS} blocks of Linear(32, 32), each fully_shard-ed, "
          + {"stack": "+ root", "roots": "each its own root (no root fully_shard)",
             "direct": "each its own root, called by the step (the fully_shard-ed Stack never runs)"}[layout]
          + "; param_dtype=bf16" + (f", reduce_dtype={reduce_dtype}" if reduce_dtype else "") + "; "
          f"instructions of {steps} steps (forward + backward) per configuration, one callgrind process each")
    shifts = 1 if args.no_aa else 3 if args.quick else 2
    ok = True
    for world in worlds:
        checkpoints = (False,) if args.quick else (True,) if args.checkpointed_only else (False, True)
        runs: list[tuple[dict, int]] = []
        rows = []
        for checkpoint in checkpoints:
            for shift in range(shifts):  # the control: unpatched and patched, each at every address shift
                runs += [(config(checkpoint, None), shift), (config(checkpoint, "upcast"), shift)]
        mixed = not args.quick and not args.no_mixed and world == worlds[0]
        if mixed:
            runs += [(config(False, None, "mixed, model.float()"), 0),
                     (config(False, "upcast", "mixed", built="upcast"), 0),
                     (config(False, "preserve", "mixed", built="preserve"), 0)]
        groups = [] if args.quick or args.no_breakdown or world != 1 else list(WRAPPER_GROUPS)
        for checkpoint in checkpoints if groups else ():
            runs += [(config(checkpoint, "upcast", bypass=group), 0) for group in groups]
        started = time.monotonic()
        counts = count(runs, world, steps, args.jobs)
        seconds = time.monotonic() - started
        per_step = [c["total"] / steps for c in counts]
        by_config: dict[str, list[float]] = {}  # per step, in the order of the address shifts
        functions_of: dict[str, list] = {}
        for (c, _), n, counted_here in zip(runs, per_step, counts):
            by_config.setdefault(json.dumps(c, sort_keys=True), []).append(n)
            functions_of.setdefault(json.dumps(c, sort_keys=True), counted_here["functions"])

        def counted(*key_args: Any, **key_kwargs: Any) -> list[float]:
            return by_config[json.dumps(config(*key_args, **key_kwargs), sort_keys=True)]

        def of(*key_args: Any, **key_kwargs: Any) -> float:
            """The count at address shift 0."""
            return counted(*key_args, **key_kwargs)[0]

        def mean(*key_args: Any, **key_kwargs: Any) -> float:
            return statistics.fmean(counted(*key_args, **key_kwargs))

        added: dict[bool, float] = {}
        for checkpoint in checkpoints:
            base, patched = mean(checkpoint, None), mean(checkpoint, "upcast")
            repeats = (counted(checkpoint, None), counted(checkpoint, "upcast"))
            spread = max(max(r) - min(r) for r in repeats)
            control = f"{spread:,.0f}" if shifts > 1 else "-"
            added[checkpoint] = patched - base
            per_forward = added[checkpoint] / forwards_per_step(checkpoint)
            bound = BOUND_PER_FORWARD[checkpoint]
            # Note: a miss is what the plugin adds beyond the spread of one configuration over the
            # address shifts: that much comes from where things lie, not from what runs.
            met = (added[checkpoint] - spread) / forwards_per_step(checkpoint) <= bound
            ok &= met
            rows.append(["per-block non-reentrant checkpoint" if checkpoint else "no checkpoint", f"{base:,.0f}",
                         f"{added[checkpoint]:+,.0f} ({added[checkpoint] / base:+.2%})",
                         f"{per_forward:,.0f} ({forwards_per_step(checkpoint)} forwards)",
                         control, f"<= {bound:,}" + ("" if met else " MISSED")])
        print(f"\nworld size {world} ({'gloo, HashStore' if world == 1 else 'fake process group'}); "
              f"{len(runs)} callgrind processes, {seconds:.0f} s; unpatched and patched: means over {shifts} "
              "address shift(s)")
        print(table(["per step", "unpatched", "added by the plugin", "added per FSDP forward",
                     "spread over shifts per step", "bound"], rows))
        for checkpoint in checkpoints if shifts > 1 else ():
            print(f"per step at each address shift, {'per-block checkpoint' if checkpoint else 'no checkpoint'}: "
                  + "; ".join(f"{name} " + ", ".join(f"{n:,.0f}" for n in counted(checkpoint, plugin))
                              for name, plugin in (("unpatched", None), ("patched", "upcast"))))
        for checkpoint in checkpoints if args.functions else ():
            print(f"\nthe {args.functions} functions the plugin changes most, "
                  f"{'per-block checkpoint' if checkpoint else 'no checkpoint'}, per step (callgrind, exclusive)")
            print(function_table(functions_of[json.dumps(config(checkpoint, None), sort_keys=True)],
                                 functions_of[json.dumps(config(checkpoint, "upcast"), sort_keys=True)],
                                 steps, args.functions))
        if mixed:
            base = of(False, None, "mixed, model.float()")
            mixed_rows = [[strategy, f"{of(False, strategy, 'mixed', built=strategy):,.0f}",
                           f"{of(False, strategy, 'mixed', built=strategy) - base:+,.0f}",
                           f"{(of(False, strategy, 'mixed', built=strategy) - base) / BLOCKS:,.0f}"]
                          for strategy in ("upcast", "preserve")]
            print(f"\nmixed-dtype model (bf16 weights, fp32 biases in every group), no checkpoint, world size {world}: "
                  f"vs the workaround model.float() without the plugin, {base:,.0f} per step")
            print(table(["strategy", "per step", "vs model.float()", "per FSDP forward"], mixed_rows))
        if groups:
            print(f"\nbreakdown, world size {world}: what the plugin adds less with one wrapper group bypassed "
                  "(torch's original put back), per FSDP forward")
            breakdown_rows = []
            for group in groups:
                cells = [group]
                for checkpoint in checkpoints:  # both at address shift 0
                    cost = of(checkpoint, "upcast") - of(checkpoint, "upcast", bypass=group)
                    cells.append(f"{cost / forwards_per_step(checkpoint):,.0f}")
                breakdown_rows.append(cells)
            breakdown_rows.append(["all (added per FSDP forward)"]
                                  + [f"{added[c] / forwards_per_step(c):,.0f}" for c in checkpoints])
            print(table(["wrapper group", *("per-block checkpoint" if c else "no checkpoint" for c in checkpoints)],
                        breakdown_rows))
    print("\nall bounds met" if ok else "\nBOUND MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
