"""Support matrix: for each torch release, a fresh venv, the test suite and ``doctor``; one row each.

    python tools/matrix/matrix.py 2.5.1 2.13.0 2.15.0          # appends rows to tools/matrix/matrix_results.md
    python tools/matrix/matrix.py --keep-venvs 2.12.1          # keep the venv (default: removed, they are GBs)

Each row: release, whether each seed failure reproduces without the plugin and is fixed
with it (from doctor's live self-test), test counts and wall time. torch 2.15 needs
pip's torch cap lifted on this machine (see the env notes); pip's error is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "tools", "matrix", "matrix_results.md")
HEADER = (
    "| torch | dtype bug without plugin | fixed with plugin | recompute bug without plugin | fixed with plugin "
    "| tests passed / failed / skipped | wall time | notes | date |\n|---|---|---|---|---|---|---|---|---|\n"
)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def doctor_cells(stdout: str, fix: str) -> tuple[str, str]:
    """('yes'|'no'|'?', 'yes'|'no'|'n/a'|'?') from doctor's row for ``fix``."""
    row = next((line for line in stdout.splitlines() if line.startswith(fix + " ")), "")
    match = re.search(r"(not reproduced|\w+ reproduced) → (fixed|ok|still fails: \w+)", row)
    if not match:
        return "?", "?"
    reproduced = "no" if match.group(1) == "not reproduced" else f"yes ({match.group(1).split()[0]})"
    fixed = {"fixed": "yes", "ok": "n/a"}.get(match.group(2), f"no ({match.group(2)})")
    return reproduced, fixed


def test_counts(stdout: str) -> str:
    tail = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return f"{counts.get('passed', 0)} / {counts.get('failed', 0) + counts.get('error', 0)} / {counts.get('skipped', 0)}"


def measure(release: str, keep_venv: bool) -> str:
    start = time.monotonic()
    venv = tempfile.mkdtemp(prefix=f"torch-{release}-")
    notes = []
    try:
        run([sys.executable, "-m", "venv", venv], check=True)
        python = os.path.join(venv, "bin", "python")
        install = run([python, "-m", "pip", "install", "-q", f"torch=={release}"])
        if install.returncode != 0:
            reason = (install.stderr.strip().splitlines() or ["pip failed"])[-1]
            return f"| {release} | ? | ? | ? | ? | - | {time.monotonic() - start:.0f} s | not installable here: {reason} |"
        run([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"], check=True)
        doctor = run([python, "-m", "torch_fsdp_ext", "doctor"], cwd=ROOT, timeout=600)
        if doctor.returncode != 0:
            notes.append(f"doctor exit {doctor.returncode}")
        tests = run([python, "-m", "pytest", "test", "-q", "-p", "no:cacheprovider"], cwd=ROOT, timeout=3600)
        if tests.returncode not in (0, 1):
            notes.append(f"pytest exit {tests.returncode}")
        failed = re.findall(r"^FAILED (\S+)", tests.stdout, flags=re.M)
        notes += [f"FAILED {name}" for name in failed[:5]]
        dtype_repro, dtype_fixed = doctor_cells(doctor.stdout, "dtype")
        recompute_repro, recompute_fixed = doctor_cells(doctor.stdout, "recompute")
        notes += [
            line for line in doctor.stdout.splitlines()
            if line.startswith(("unsupported torch", "self-test not run"))
        ]
        return (
            f"| {release} | {dtype_repro} | {dtype_fixed} | {recompute_repro} | {recompute_fixed} "
            f"| {test_counts(tests.stdout)} | {time.monotonic() - start:.0f} s | {'; '.join(notes)} |"
        )
    finally:
        if not keep_venv:
            shutil.rmtree(venv, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("releases", nargs="+")
    parser.add_argument("--keep-venvs", action="store_true")
    args = parser.parse_args()
    if not os.path.exists(RESULTS):
        with open(RESULTS, "w") as f:
            f.write(HEADER)
    for release in args.releases:
        row = f"{measure(release, args.keep_venvs)} {datetime.date.today()} |"
        with open(RESULTS, "a") as f:
            f.write(row + "\n")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
