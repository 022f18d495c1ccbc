"""What the Lightning tools (Trainer and Fabric) share: their steps, their three jobs and the lines they print."""

from __future__ import annotations

import tempfile
from collections.abc import Collection
from importlib.metadata import version

import torch

from _jobs import ASSERTION, launch_job, launch_jobs  # the tool's folder, on its path
from _model import compare

STEPS, RESUME_STEP = 4, 2


def run_jobs(script: str, label: str, resume: str, through_launcher: Collection[str] = ()) -> tuple[bool, dict | None]:
    """Run the ``plain``, ``workaround`` and ``plugin`` jobs of ``script`` (those in ``through_launcher`` through the
    launcher) and print the versions, whether plain failed with the assertion, plugin against workaround, and
    plugin's run resumed by ``resume`` against its uninterrupted one. Whether each is what docs/integrations.md
    says, and the jobs' results (False and None once a job fails)."""
    with tempfile.TemporaryDirectory() as root:
        plain, _ = launch_job(script, "plain", root)
        results = launch_jobs(script, label, ("workaround", "plugin"), root, through_launcher)
    if results is None:
        return False, None
    print(f"torch {torch.__version__}, lightning {version('lightning')}, 2 gloo ranks, {STEPS} steps")
    failed = plain.returncode != 0 and ASSERTION in plain.stderr
    print(f"{label}: without plugin: {'AssertionError: ' + ASSERTION if failed else 'NO ASSERTION'}")
    lines, plugin_exact = compare(label, results["plugin"], results["workaround"], "model.float()")
    print("\n".join(lines))
    uninterrupted = {"losses": results["plugin"]["losses"][RESUME_STEP:], "params": results["plugin"]["params"]}
    lines, resume_exact = compare(f"{label}: {resume}", results["plugin"]["resumed"], uninterrupted, "uninterrupted",
                                  result_name="resumed")
    print("\n".join(lines))
    return failed and plugin_exact and resume_exact, results
