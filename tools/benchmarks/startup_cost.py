"""What ``TORCH_FSDP_EXT_AUTOLOAD=1`` costs a process, side by side with the variable unset.

    python tools/benchmarks/startup_cost.py # 10 rounds; exit 1 if a process that never imports FSDP pays anything
    python tools/benchmarks/startup_cost.py --rounds 3

For ``import torch`` (a process that never uses FSDP: pip's build step, a data worker,
``python -c``) and for ``import torch.distributed.fsdp`` (a training process), each round
starts one fresh interpreter with the variable unset and one with it set, in alternating
order, and records wall time and the modules loaded. Prints medians and the ratio.
Bound: under ``import torch`` the variable loads no module but the stdlib-only hook (the plugin is not imported).
Needs the package installed (``pip install -e .``): the start-up hook is a ``.pth`` file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Modules counted without the start-up hook itself (standard library only, imported whenever the variable is set).
PROBE = (
    "import sys, {module}; "
    "print(len(set(sys.modules) - {{'torch_fsdp_ext_startup'}}), 'torch_fsdp_ext' in sys.modules, 'torch._dynamo' in sys.modules)"
)


def start(module: str, autoload: bool) -> tuple[float, int, bool, bool]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FSDP_EXT_")}
    if autoload:
        env["TORCH_FSDP_EXT_AUTOLOAD"] = "1"
    begin = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                            env=env, check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    elapsed = time.perf_counter() - begin
    modules, plugin, dynamo = result.stdout.split()
    return elapsed, int(modules), plugin == "True", dynamo == "True"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; {args.rounds} rounds, alternating; medians")
    print(f"{'process imports':<28}{'AUTOLOAD':>10}{'wall s':>10}{'modules':>10}{'plugin':>8}{'dynamo':>8}")
    ok = True
    summary = {}
    for module in ("torch", "torch.distributed.fsdp"):
        runs: dict[bool, list] = {False: [], True: []}
        for round_index in range(args.rounds):
            for autoload in ((False, True) if round_index % 2 == 0 else (True, False)):
                runs[autoload].append(start(module, autoload))
        for autoload in (False, True):
            samples = runs[autoload]
            wall = statistics.median(s[0] for s in samples)
            modules = statistics.median(s[1] for s in samples)
            plugin, dynamo = samples[-1][2], samples[-1][3]
            summary[(module, autoload)] = (wall, modules)
            print(f"{module:<28}{'set' if autoload else 'unset':>10}{wall:>10.2f}{modules:>10.0f}{plugin!s:>8}{dynamo!s:>8}")
        ratio = summary[(module, True)][0] / summary[(module, False)][0]
        extra = summary[(module, True)][1] - summary[(module, False)][1]
        print(f"{module:<28}{'ratio':>10}{ratio:>10.2f}{extra:>+10.0f}")
        if module == "torch" and (extra != 0 or any(s[2] for s in runs[True])):
            ok = False
    print(json.dumps({"bound: import torch loads no extra module": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
