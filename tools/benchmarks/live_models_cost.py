"""What a model's decisions cost while other FSDP2 models are alive, plugin vs reference, one rank.

    python tools/benchmarks/live_models_cost.py                 # 1, 10, 100 and 1,000 live models, best of 3
    python tools/benchmarks/live_models_cost.py --live 1 200    # other counts

For each count N, N - 1 other models are sharded and left undecided (built, never given to an
optimizer nor run: a reference, reward or value model that waits for its turn), then a new model
is sharded and timed three times (each time a fresh one; the best is printed):

- first optimizer: ``AdamW(model.parameters())``, the plugin's upcast moment;
- first train step: forward, backward and ``step()`` (FSDP's lazy init, the rank check);
- second optimizer: another ``AdamW`` on the same, now upcast, model.

Models: two blocks of a bf16 ``Linear(32, 32)`` and an fp32 ``LayerNorm``, each block and the
root sharded (``fully_shard``, bf16 compute). Reference: the plugin off and ``model.float()``
before ``fully_shard``, the hand workaround. Each side runs in its own process (gloo, world
size 1, a ``HashStore``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DIM = 32
TRIALS = 3


def measure(plugin: bool, counts: list[int]) -> dict[int, dict[str, float]]:
    if not plugin:
        os.environ["TORCH_FSDP_EXT_DISABLE"] = "1"
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import torch_fsdp_ext  # noqa: F401 - installs the fixes unless disabled
    from torch_fsdp_ext._compat import fsdp2_api

    fully_shard, policy = fsdp2_api().fully_shard, fsdp2_api().MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(DIM, DIM).to(torch.bfloat16), nn.LayerNorm(DIM))

    def sharded_model() -> nn.Module:
        model = nn.Sequential(block(), block())
        if not plugin:
            model.float()
        for sub in model:
            fully_shard(sub, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)

    def timed(fn) -> tuple[float, object]:
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e3, out

    others: list[nn.Module] = []
    results = {}
    x = torch.randn(4, DIM)
    for count in counts:
        while len(others) < count - 1:
            others.append(sharded_model())
        best = {"first optimizer": float("inf"), "first step": float("inf"), "second optimizer": float("inf")}
        for _ in range(TRIALS):
            model = sharded_model()
            ms, optimizer = timed(lambda: torch.optim.AdamW(model.parameters(), lr=1e-3))
            best["first optimizer"] = min(best["first optimizer"], ms)
            assert model[0][0].weight.dtype == torch.float32  # the plugin's upcast was timed (the reference's float())

            def step() -> None:
                model(x).float().sum().backward()
                optimizer.step()
                optimizer.zero_grad()

            ms, _ = timed(step)
            best["first step"] = min(best["first step"], ms)
            ms, _ = timed(lambda: torch.optim.AdamW(model.parameters(), lr=1e-3))
            best["second optimizer"] = min(best["second optimizer"], ms)
            del model, optimizer
        results[count] = best
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--side", choices=["plugin", "reference"], help=argparse.SUPPRESS)  # one side, as JSON
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side == "plugin", args.live)))
        return
    sides = {}
    for side in ("reference", "plugin"):
        done = subprocess.run([sys.executable, __file__, "--side", side, "--live", *map(str, args.live)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{side} run failed:\n{done.stderr}")
        sides[side] = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    import torch

    print(f"torch {torch.__version__}, one rank, best of {TRIALS}, ms (reference -> plugin)")
    print("| live FSDP models | first AdamW | first train step | a second AdamW on the upcast model |")
    print("|---|---|---|---|")
    for count in args.live:
        ref, plug = sides["reference"][count], sides["plugin"][count]
        cells = [f"{ref[k]:.2f} → {plug[k]:.2f}" for k in ("first optimizer", "first step", "second optimizer")]
        print(f"| {count:,} | " + " | ".join(cells) + " |")
    first = [sides["plugin"][count]["first optimizer"] for count in args.live]
    ratio = first[-1] / first[0]
    print(f"plugin's first AdamW with {args.live[-1]:,} live models / with {args.live[0]:,}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
