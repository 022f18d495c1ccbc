"""Instructions the plugin adds per FSDP forward, counted by callgrind: deterministic where time is not.

    python tools/bench_instructions.py                # world 1 and 2, no / per-block checkpoint, mixed model,
                                                      # per-wrapper breakdown; bounds checked (exit 1 if missed)
    python tools/bench_instructions.py --world 1 --no-breakdown --no-mixed   # the four counts of one world size
    python tools/bench_instructions.py --quick        # CI form: one configuration pair, 2 steps, no bounds
    python tools/bench_instructions.py --bytecodes    # no valgrind, seconds: the plugin's Python bytecodes per step

Each count is ``torch.utils.benchmark.Timer(...).collect_callgrind()`` of 10 training steps (forward,
``.sum().backward()``) of a stack of 8 blocks (``Linear(32, 32)``), each ``fully_shard``-ed, plus the root,
``param_dtype=bf16``. "added per FSDP forward" is the plugin's added count divided by the blocks' forwards
(8 per step, and 8 recomputes more with per-block checkpointing); the root's forward is in the total.

Note: how the counts are taken. Callgrind re-imports torch in a fresh ``python``
from PATH (this interpreter's directory is put first) and instruments everything:
minutes per process. So one process counts every configuration in turn: the
Timer's statement runs one configuration's steps, then pauses collection
(``torch._C._valgrind_toggle``) while it builds and warms up the next one. The
process runs with ``PYTHONHASHSEED=0``. Known limit: within one process the counts
do not repeat (A/A of ~250k instructions per step in 18 M on 2.13.0, 2026-12-01);
fresh processes per count repeat to ~150. The A/A column shows it.

Note: world size 2 runs on torch's fake process group (collectives move no data),
in the one callgrind process: FSDP shards as on two ranks and the plugin's
per-forward paths are the same as on a real group (none of them talks to the
other ranks after the first forward), while counts stay exact. Gloo's own work
for real collectives is torch's, the same with and without the plugin.

Note: the breakdown bypasses one group of the plugin's wrappers at a time (the
torch original is put back for that configuration only) and reports what the
plugin then adds less: the instructions that wrapper group costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)

from bench_cpu import Stack, step, table  # noqa: E402 (also sets TORCH_FSDP_EXT_DISABLE: we install explicitly)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_fsdp_ext  # noqa: E402
from torch_fsdp_ext import _install, _patching  # noqa: E402
from torch_fsdp_ext._compat import fsdp2_api  # noqa: E402

BLOCKS = 8
STEPS = 10
WARMUP_STEPS = 3
# 2.13.0, world size 1: at most half of what the plugin added before this tool existed (7,320 and 33,616).
BOUND_PER_FORWARD = {False: 3_500, True: 16_000}
PLAN_ENV = "TORCH_FSDP_EXT_INSTRUCTION_PLAN"

# Wrapper groups the breakdown bypasses one at a time: (fix, torch attributes it wraps).
WRAPPER_GROUPS = {
    "FSDPState._lazy_init (rank check)": ("dtype", {"_lazy_init"}),
    "FSDPState._pre_forward": ("recompute", {"_pre_forward"}),
    "FSDPState._post_forward": ("recompute", {"_post_forward"}),
    "checkpoint hooks __init__/__enter__/__exit__": ("recompute", {"__init__", "__enter__", "__exit__"}),
    "reduce path (foreach_reduce, to_sharded_dtensor)": ("dtype", {"foreach_reduce", "to_sharded_dtensor"}),
}


# -- what runs inside the callgrind process ------------------------------------------


def valgrind_toggle() -> None:
    """Switch callgrind's collection on or off (a no-op outside valgrind)."""
    torch._C._valgrind_toggle()


def under_valgrind() -> bool:
    return "vgpreload" in os.environ.get("LD_PRELOAD", "")


class Bypass:
    """Put torch's originals back for one wrapper group (the plugin stays installed otherwise)."""

    def __init__(self, group: str | None) -> None:
        self.swapped: list[tuple[Any, str, Any]] = []
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

    def undo(self) -> None:
        for owner, name, wrapper in self.swapped:
            setattr(owner, name, wrapper)


def build(config: dict) -> torch.nn.Module:
    """The configuration's model, sharded with the plugin in the state named by ``config["built"]``."""
    api = fsdp2_api()
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
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
    api.fully_shard(model, mp_policy=policy)
    return model


def switch(plugin: str | None, bypass: str | None = None) -> Bypass:
    """Install the plugin with this dtype strategy (None: uninstall it), one wrapper group bypassed."""
    torch_fsdp_ext.uninstall()
    if plugin is None:
        return Bypass(None)
    torch_fsdp_ext.install(dtype_strategy=plugin)
    bypassed = Bypass(bypass)
    if bypass is not None:
        fix, patches = _install._active["recompute"]
        fix.rebind_existing_hooks(patches)  # hooks bound to a bypassed wrapper go back to torch's own
    return bypassed


class Plan:
    """The configurations one callgrind process counts, one per call of ``run()`` (the Timer's statement).

    Note: configurations that differ only in the plugin's state share one model
    (``install()`` re-binds its FSDP hooks, ``uninstall()`` restores them), so that
    they count the same objects at the same addresses: models built one after the
    other differ by about 0.7 % per step in one process (allocator state, address-keyed
    hashing), twice what the plugin adds. Sharing the model was not enough (module note).
    """

    def __init__(self, configs: list[dict], world: int, steps: int) -> None:
        self.configs, self.steps, self.index = configs, steps, -1
        self.models: dict[str, torch.nn.Module] = {}
        self.model: torch.nn.Module | None = None
        self.bypass = Bypass(None)
        self.x = torch.randn(8, 32)
        if world == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    @classmethod
    def from_env(cls) -> Plan | None:
        """The plan passed by the driver; None outside valgrind (the Timer's own trial run in the driver)."""
        if not under_valgrind():
            return None
        spec = json.loads(os.environ[PLAN_ENV])
        return cls(spec["configs"], spec["world"], spec["steps"])

    def prepare(self, index: int) -> None:
        self.bypass.undo()
        self.index = index
        if index < len(self.configs):
            config = self.configs[index]
            key = json.dumps([config["model"], config["checkpoint"], config["built"], config.get("copy", 0)])
            if key not in self.models:
                self.models[key] = build(config)
            self.model = self.models[key]
            self.bypass = switch(config["plugin"], config["bypass"])
            for _ in range(WARMUP_STEPS):  # lazy init, rank check, caches
                step(self.model, self.x)

    def run(self) -> None:
        if self.index < 0:  # the Timer's warm-up call, not counted
            self.prepare(0)
            return
        for _ in range(self.steps):
            step(self.model, self.x)
        valgrind_toggle()  # off: switching to the next configuration is not counted
        self.prepare(self.index + 1)
        valgrind_toggle()


def run_statement(plan: Plan | None) -> None:
    if plan is not None:
        plan.run()


# -- the driver ----------------------------------------------------------------------


def count(configs: list[dict], world: int, steps: int) -> list[int]:
    """Instructions of ``steps`` steps of each configuration, from one callgrind process."""
    from torch.utils.benchmark import Timer

    os.environ[PLAN_ENV] = json.dumps({"configs": configs, "world": world, "steps": steps})
    os.environ["PYTHONHASHSEED"] = "0"
    # collect_callgrind starts ``python`` from PATH: make it this interpreter (and its venv).
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    timer = Timer(
        stmt="bench_instructions.run_statement(plan)",
        setup=f"import sys; sys.path.insert(0, {TOOLS_DIR!r}); import bench_instructions; "
        "plan = bench_instructions.Plan.from_env()",
    )
    stats = timer.collect_callgrind(number=1, repeats=len(configs), collect_baseline=False)
    return [s.counts(denoise=False) for s in stats]


def config(checkpoint: bool, plugin: str | None, model: str = "plain", bypass: str | None = None,
           built: str | None = None, copy: int = 0) -> dict:
    """What one count runs: ``model`` sharded with the plugin in state ``built``, run in state ``plugin``."""
    return {"checkpoint": checkpoint, "plugin": plugin, "model": model, "bypass": bypass, "built": built,
            "copy": copy}


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
        step(model, x)
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
        step(model, x)
    finally:
        sys.settrace(None)
        torch_fsdp_ext.uninstall()
        dist.destroy_process_group()
    return {name: (ops, calls) for name, (ops, calls) in counts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, choices=[1, 2], action="append", help="world size(s); default 1 and 2")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-wrapper breakdown")
    parser.add_argument("--no-mixed", action="store_true", help="skip preserve/upcast on the mixed-dtype model")
    parser.add_argument("--quick", action="store_true", help="CI: world 1, no checkpoint, 2 steps, bounds not enforced")
    parser.add_argument("--bytecodes", action="store_true", help="count the plugin's Python bytecodes (no valgrind)")
    args = parser.parse_args()
    if args.bytecodes:
        print(f"torch {torch.__version__}: the plugin's Python bytecodes in one step, {BLOCKS} blocks, world size 1")
        for checkpoint in (False, True):
            counts = count_bytecodes(checkpoint)
            rows = [[name, f"{ops:,}", str(calls)] for name, (ops, calls) in sorted(counts.items(), key=lambda kv: -kv[1][0])]
            rows.append(["total", f"{sum(o for o, _ in counts.values()):,}", str(sum(c for _, c in counts.values()))])
            print(f"\n{'per-block checkpoint' if checkpoint else 'no checkpoint'}")
            print(table(["function", "bytecodes", "calls"], rows))
        return 0
    worlds = [1] if args.quick else (args.world or [1, 2])
    steps = 2 if args.quick else STEPS
    needed = {name: torch_fsdp_ext.status().fixes[name].needed for name in torch_fsdp_ext.FIX_NAMES}
    print(f"torch {torch.__version__}, torch_fsdp_ext {torch_fsdp_ext.__version__}, python {sys.version.split()[0]}, "
          f"PYTHONHASHSEED=0, {time.strftime('%Y-%m-%d', time.gmtime())}; fixes this torch needs: "
          + ", ".join(name for name, n in needed.items() if n))
    print(f"{BLOCKS} blocks of Linear(32, 32), each fully_shard-ed, + root; param_dtype=bf16; "
          f"instructions of {steps} steps (forward + backward) per configuration")
    ok = True
    for world in worlds:
        checkpoints = (False,) if args.quick else (False, True)
        configs, rows = [], []
        for checkpoint in checkpoints:
            # Unpatched, patched, and each again: the repeats are the A/A controls.
            configs += [config(checkpoint, None), config(checkpoint, "upcast")] * 2
        if not args.quick and not args.no_mixed:
            configs += [config(False, None, "mixed, model.float()"), config(False, "upcast", "mixed", built="upcast"),
                        config(False, "preserve", "mixed", built="preserve"),
                        config(False, None, "mixed, model.float()", copy=1)]
        groups = [] if args.quick or args.no_breakdown or world != 1 else list(WRAPPER_GROUPS)
        for checkpoint in checkpoints if groups else ():
            configs += [config(checkpoint, "upcast", bypass=group) for group in groups]
        started = time.monotonic()
        counts = count(configs, world, steps)
        seconds = time.monotonic() - started
        per_step = [c / steps for c in counts]
        by_config: dict[str, list[float]] = {}
        for c, n in zip(configs, per_step):
            by_config.setdefault(json.dumps(c, sort_keys=True), []).append(n)

        def of(*key_args: Any, **key_kwargs: Any) -> float:
            return by_config[json.dumps(config(*key_args, **key_kwargs), sort_keys=True)][0]

        def again(*key_args: Any, **key_kwargs: Any) -> float:
            return by_config[json.dumps(config(*key_args, **key_kwargs), sort_keys=True)][1]

        added: dict[bool, float] = {}
        for checkpoint in checkpoints:
            base, patched = of(checkpoint, None), of(checkpoint, "upcast")
            control = max(abs(again(checkpoint, None) - base), abs(again(checkpoint, "upcast") - patched))
            added[checkpoint] = patched - base
            per_forward = added[checkpoint] / forwards_per_step(checkpoint)
            bound = BOUND_PER_FORWARD[checkpoint]
            met = per_forward <= bound
            ok &= met
            rows.append(["per-block non-reentrant checkpoint" if checkpoint else "no checkpoint", f"{base:,.0f}",
                         f"{added[checkpoint]:+,.0f} ({added[checkpoint] / base:+.2%})",
                         f"{per_forward:,.0f} ({forwards_per_step(checkpoint)} forwards)",
                         f"{control:,.0f}", f"<= {bound:,}" + ("" if met else " MISSED")])
        print(f"\nworld size {world} ({'gloo, HashStore' if world == 1 else 'fake process group'}); "
              f"one callgrind process, {seconds:.0f} s")
        print(table(["per step", "unpatched", "added by the plugin", "added per FSDP forward", "A/A per step", "bound"],
                    rows))
        if not args.quick and not args.no_mixed:
            base = of(False, None, "mixed, model.float()")
            mixed_rows = [[strategy, f"{of(False, strategy, 'mixed', built=strategy):,.0f}",
                           f"{of(False, strategy, 'mixed', built=strategy) - base:+,.0f}",
                           f"{(of(False, strategy, 'mixed', built=strategy) - base) / BLOCKS:,.0f}"]
                          for strategy in ("upcast", "preserve")]
            rebuilt = of(False, None, "mixed, model.float()", copy=1) - base
            print(f"\nmixed-dtype model (bf16 weights, fp32 biases in every group), no checkpoint, world size {world}: "
                  f"vs the workaround model.float() without the plugin, {base:,.0f} per step. Each is a model of its "
                  f"own: the same model.float() built again counts {rebuilt:+,.0f} per step")
            print(table(["strategy", "per step", "vs model.float()", "per FSDP forward"], mixed_rows))
        if groups:
            print(f"\nbreakdown, world size {world}: what the plugin adds less with one wrapper group bypassed "
                  "(torch's original put back), per FSDP forward")
            breakdown_rows = []
            for group in groups:
                cells = [group]
                for checkpoint in checkpoints:
                    cost = added[checkpoint] - (of(checkpoint, "upcast", bypass=group) - of(checkpoint, None))
                    cells.append(f"{cost / forwards_per_step(checkpoint):,.0f}")
                breakdown_rows.append(cells)
            breakdown_rows.append(["all (added per FSDP forward)"]
                                  + [f"{added[c] / forwards_per_step(c):,.0f}" for c in checkpoints])
            print(table(["wrapper group", "no checkpoint", "per-block checkpoint"], breakdown_rows))
    print("\nall bounds met" if ok else "\nBOUND MISSED" + (" (not enforced with --quick)" if args.quick else ""))
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
