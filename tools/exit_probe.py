"""Does a 2-rank gloo job abort at exit ("terminate called without an active exception"), and is it the plugin?

    python tools/exit_probe.py [--runs 5]

Runs a small training job (the seed-000 layout: bf16 linears with fp32 norms, 3 steps) under
torchrun with 2 CPU ranks, in four setups taken in turn: with and without the plugin (without
it, the job casts the model to fp32 itself), and with and without ``dist.barrier()`` before
``dist.destroy_process_group()``. Prints, per setup, how many runs exited non-zero and how many
printed the abort.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile

JOB = '''
import sys
import torch, torch.nn as nn, torch.distributed as dist
plugin, barrier = sys.argv[1] == "plugin", sys.argv[2] == "barrier"
if plugin:
    import torch_fsdp_ext
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3)))
for block in model:
    block[0].to(torch.bfloat16)
if not plugin:
    model.float()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model:
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(3):
    model(torch.randn(4, 16)).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
if barrier:
    dist.barrier()
dist.destroy_process_group()
'''

ABORT = "terminate called without an active exception"


def run_job(script: str, plugin: bool, barrier: bool) -> tuple[bool, bool]:
    """(exited non-zero, printed the abort) for one torchrun launch."""
    env = dict(os.environ)
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
         "plugin" if plugin else "plain", "barrier" if barrier else "no-barrier"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    return result.returncode != 0, ABORT in result.stdout + result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="launches per setup (default 5)")
    args = parser.parse_args()
    import torch

    setups = list(itertools.product((False, True), (False, True)))  # (plugin, barrier)
    counts = {setup: [0, 0] for setup in setups}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        for _ in range(args.runs):
            for setup in setups:  # in turn, so that a busy spell hits every setup alike
                failed, aborted = run_job(script, *setup)
                counts[setup][0] += failed
                counts[setup][1] += aborted
    print(f"torch {torch.__version__}, 2 gloo CPU ranks under torchrun, {args.runs} runs per setup")
    print(f"{'plugin':<8}{'barrier before teardown':<25}{'non-zero exit':<15}abort printed")
    for (plugin, barrier), (failed, aborted) in counts.items():
        print(f"{'yes' if plugin else 'no':<8}{'yes' if barrier else 'no':<25}{failed:<15}{aborted}")


if __name__ == "__main__":
    main()
