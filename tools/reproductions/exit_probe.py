"""How often does a 2-rank gloo job abort at exit ("terminate called without an active exception"),
and does the recommended end of a rank remove it?

    python tools/reproductions/exit_probe.py [--runs 20]

Plain torch (no plugin), 2 gloo ranks on CPU. The job builds a ``DeviceMesh`` (as ``fully_shard``
does), runs a few synchronous ``all_reduce`` steps and ends in one of two ways, taken in turn so
that a busy spell hits both alike:

- ``destroy, then exit``: ``dist.destroy_process_group()`` and the script ends (the mesh, which a
  model would hold, keeps the group and its gloo worker threads alive into interpreter shutdown);
- ``recommended end``: ``dist.barrier()``, ``dist.destroy_process_group()``, flush, ``os._exit(0)``
  (``torch_fsdp_ext._rank_end.end_rank``; docs/reliability.md, "Abort at exit").

Each rank is started directly with the variables torchrun gives it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so its exit status and stderr are its own. Prints, per end, how
many runs had a rank that exited non-zero and how many had a rank that aborted (SIGABRT or the
message on the rank's own stderr).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

JOB = '''
import os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
metric = torch.ones(1024)
for step in range(3):
    dist.all_reduce(metric)
if sys.argv[1] == "recommended":
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
dist.destroy_process_group()
'''

ENDS = {"destroy, then exit": "plain", "recommended end": "recommended"}
ABORT = "terminate called without an active exception"
RUN_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: str, end: str) -> tuple[bool, bool]:
    """(a rank exited non-zero, a rank aborted) for one 2-rank job."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FSDP_EXT_")}
    ranks = [
        subprocess.Popen([sys.executable, script, end], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(env, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for rank in (0, 1)
    ]
    failed = aborted = False
    for process in ranks:
        try:
            _, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        failed |= process.returncode != 0
        aborted |= process.returncode == -6 or ABORT in stderr
    return failed, aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="jobs per end (default 20)")
    args = parser.parse_args()
    import torch

    counts = {name: [0, 0] for name in ENDS}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        for _ in range(args.runs):
            for name, end in ENDS.items():
                failed, aborted = run_job(script, end)
                counts[name][0] += failed
                counts[name][1] += aborted
    print(f"torch {torch.__version__}, plain torch, 2 gloo CPU ranks, {args.runs} jobs per end")
    print(f"{'end of the ranks':<20}{'non-zero exit':<15}aborted")
    for name, (failed, aborted) in counts.items():
        print(f"{name:<20}{f'{failed} of {args.runs}':<15}{aborted} of {args.runs}")


if __name__ == "__main__":
    main()
