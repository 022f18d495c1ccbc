"""What the two Lightning tools (Trainer and Fabric) share: their steps and the result lines both print."""

from __future__ import annotations

import subprocess
from importlib.metadata import version

import torch

from _jobs import ASSERTION  # the tool's folder, on its path
from _model import compare

STEPS, RESUME_STEP = 4, 2


def report(label: str, plain: subprocess.CompletedProcess, results: dict, resume: str) -> bool:
    """Print the versions, whether the ``plain`` job failed with the assertion, the ``plugin`` job against the
    ``workaround`` one, and the ``plugin`` job's run resumed by ``resume`` against its uninterrupted one; whether
    each is what docs/integrations.md says."""
    print(f"torch {torch.__version__}, lightning {version('lightning')}, 2 gloo ranks, {STEPS} steps")
    failed = plain.returncode != 0 and ASSERTION in plain.stderr
    print(f"{label}: without plugin: {'AssertionError: ' + ASSERTION if failed else 'NO ASSERTION'}")
    line, plugin_exact = compare(label, results["plugin"], results["workaround"], "model.float()")
    print(line)
    uninterrupted = {"losses": results["plugin"]["losses"][RESUME_STEP:], "params": results["plugin"]["params"]}
    line, resume_exact = compare(f"{label}: {resume}", results["plugin"]["resumed"], uninterrupted, "uninterrupted")
    print(line)
    return failed and plugin_exact and resume_exact
