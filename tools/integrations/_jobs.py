"""How an integration tool runs: each variant is a job in processes of its own, started by the tool's ``main``
through the command line every tool has.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable

import torch

ASSERTION = "FSDP expects uniform original parameter dtype"


def launch_job(script: str, variant: str, root: str, through_launcher: bool = False, torchrun: bool = False,
               settings: dict[str, str] | None = None):
    """Run ``script --job VARIANT ROOT RESULT``: a job that starts its ranks itself, or, with ``torchrun``, one that
    ``torchrun --nproc-per-node 2`` starts; with ``python -m torch_fsdp_ext.run`` in front if ``through_launcher``,
    and ``settings`` (TORCH_FSDP_EXT_* variables) in its environment. The process and the job's result, if any."""
    result_path = os.path.join(root, f"{variant}.pt")
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"] if torchrun else []
    launcher += ["-m", "torch_fsdp_ext.run"] if through_launcher else []
    # Note: no TORCH_FSDP_EXT_* setting of the caller reaches a job; only the job's own turn the plugin on.
    env = {name: value for name, value in os.environ.items() if not name.startswith("TORCH_FSDP_EXT_")}
    env.update(settings or {})
    process = subprocess.run(
        [sys.executable, *launcher, os.path.abspath(script), "--job", variant, root, result_path],
        capture_output=True, text=True, timeout=600, env=env,
    )
    return process, torch.load(result_path) if os.path.exists(result_path) else None


def launch_jobs(script: str, label: str, variants: Iterable[str], root: str, through_launcher: Collection[str] = (),
                torchrun: bool = False) -> dict | None:
    """The result of each of ``variants``' jobs (those in ``through_launcher`` started through the launcher); None
    once one fails, its output and a line saying so printed."""
    results = {}
    for variant in variants:
        process, results[variant] = launch_job(script, variant, root, variant in through_launcher, torchrun)
        if process.returncode != 0 or results[variant] is None:
            print(process.stdout + process.stderr)
            print(f"{label}: the {variant} job failed (exit {process.returncode})")
            return None
    return results


def run_tool(description: str, job: Callable[[str, str, str], None], main: Callable[[], int]) -> None:
    """The tool's command line: with ``--job VARIANT ROOT RESULT`` one rank of that job, else ``main``, which
    launches the jobs and exits with its status."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", nargs=3, metavar=("VARIANT", "ROOT", "RESULT"))
    arguments = parser.parse_args()
    if arguments.job:
        job(*arguments.job)
        from torch_fsdp_ext._rank_end import end_rank  # the job is over: what importing the package installs is unused

        end_rank()
    sys.exit(main())
