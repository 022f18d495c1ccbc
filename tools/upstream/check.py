"""Prove that each upstream PR alone fixes its failure, without touching the installed torch.

    python tools/upstream/check.py            # on torch 2.15.0, the release the patches are against
    python tools/upstream/check.py -k parity  # extra pytest arguments go to every patched run

For each patch in ``PATCHES``:

1. copies the installed torch's FSDP2 package (``torch/distributed/fsdp/_fully_shard``)
   into a temporary directory, with the patch's test frames (``Patch.frames``: stand-ins for
   the upstream test files its test hunks change, which are not shipped with torch),
2. checks that the patch applies (``git apply --check``); for a patch with
   ``unpatched_error``, applies only its test hunks first and runs its test classes on the
   unpatched FSDP2: each test must fail with that error,
3. applies the patch and runs, with FSDP2 imported from the patched copy (a
   ``sitecustomize`` there redirects ``torch.distributed.fsdp._fully_shard`` in every test
   process) and the plugin disabled: the patch's test file as torch's harness runs it (only
   with an accelerator: see ``NO_ACCELERATOR``), the same test classes on CPU with gloo
   (``test_on_cpu.py``), and the patch's project tests. Tests of the plugin's own machinery
   are skipped in that run (``plugin_specific`` in test/common.py).

Then:

- ``PREVIOUS_PR2``: PR 2's earlier versions, each applied to a fresh copy, with the cases
  its review found (in ``test_recompute_inputs_on_cpu.py``): each case must fail there (they
  pass on PR 2);
- the review cases on the installed, unpatched torch: each must pass, i.e. PR 2 gives what
  unpatched torch gives (``UNPATCHED_EQUAL``);
- the stack: the patches apply one after the other on one copy;
- for information only (never a failure): torch's gloo teardown abort, counted by
  ``gloo_exit_abort_repro.py --runs GLOO_RUNS`` if that script is present.

Exits non-zero if any step fails; the summary names each failed step and test (with its
exception line, e.g. a rank's assertion or a timeout) and how long each step took.

Timeouts are explicit and generous, since CI machines may be loaded: each
multi-process test (all subtests of a torch-style test run in one) may take
``TEST_TIMEOUT_S`` before its processes are killed and it fails as timed out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PACKAGE = "torch/distributed/fsdp/_fully_shard"
BASE_RELEASE = "2.15.0"
# Seconds one multi-process test may run (torch's default is 300; a torch-style test with
# all its subtests takes about a minute on a loaded 2-core machine).
TEST_TIMEOUT_S = 900


class Patch(NamedTuple):
    file: str  # in tools/upstream/
    upstream_test: str  # the test file the patch changes, relative to torch's repository root
    project_tests: tuple[str, ...]  # relative to this repository's root
    # Whether the upstream test's devices only stand for ranks: then test_on_cpu.py runs
    # its skip_if_lt_x_gpu(n) tests with n gloo ranks on CPU
    ranks_for_devices: bool
    # Test files the patch changes (relative to torch's repository root), each with the
    # stand-in in tools/upstream/ that is laid there before the patch is applied
    frames: tuple[tuple[str, str], ...] = ()
    # The error each of the patch's tests must fail with on unpatched FSDP2; None: not run
    unpatched_error: str | None = None


MIXED_PRECISION_TEST = "test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py"

# The stack, in order. Project tests: PR 1 has the semantics of dtype_strategy="preserve"
# (test_preserve.py; test_dtype.py tests the plugin's upcast, which the native patch does
# not do); PR 2 replays the root's input move (test_recompute.py, and the CPU version of
# its own test's scenarios and of its reviews' cases).
PATCHES = (
    Patch(
        "pr1-mixed-orig-dtypes.patch",
        MIXED_PRECISION_TEST,
        ("test/test_preserve.py",),
        ranks_for_devices=True,
        frames=((MIXED_PRECISION_TEST, "frame_test_fully_shard_mixed_precision.py"),),
        unpatched_error="FSDP expects uniform original parameter dtype",
    ),
    Patch(
        "pr2-recompute-root-input-move.patch",
        "test/distributed/_composable/fsdp/test_fully_shard_recompute_inputs.py",
        ("test/test_recompute.py", "tools/upstream/test_recompute_inputs_on_cpu.py"),
        ranks_for_devices=False,  # its test moves CPU inputs to a real accelerator
    ),
)

# PR 2's previous versions, kept to show that the cases each review found are the new
# tests' failures: each selected test must fail against that version and pass against PR 2.
# v3: cases 1(a)-(c) and 2 of its review (case 2 in its flat form, only the root sharded,
# where v3 trains on silently with another mask). v4: the three cases of its review where
# it raised and unpatched torch runs, and the bound on its records.
REVIEW_CASES_TEST = "tools/upstream/test_recompute_inputs_on_cpu.py"
PREVIOUS_PR2 = {
    "pr2-recompute-root-input-move-v3.patch": ("test_review_case_case_review_1", "test_review_case_case_review_2_root"),
    "pr2-recompute-root-input-move-v4.patch": ("test_review_v4_case", "test_records_bounded"),
}
# On the installed torch, which PR 2 must equal there
UNPATCHED_EQUAL = "test_review_case or test_review_v4_case or test_records_bounded"

GLOO_REPRO = "gloo_exit_abort_repro.py"
GLOO_RUNS = 3
GLOO_TIMEOUT_S = 300

REDIRECT = '''\
# Written by tools/upstream/check.py: import FSDP2 from the patched copy next to this file.
import importlib.abc
import importlib.util
import os
import sys

_NAME = "torch.distributed.fsdp._fully_shard"
_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), *_NAME.split("."))


class _PatchedFullyShard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _NAME:
            return None  # submodules follow the package's __path__, i.e. the patched copy
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(_DIR, "__init__.py"), submodule_search_locations=[_DIR]
        )


sys.meta_path.insert(0, _PatchedFullyShard())
'''


# Note: the PR tests size their world by the accelerator count, as torch's FSDP tests do, so
# on a machine without one MultiProcessTestCase spawns no process and reports a pass; with a
# fixed world size, FSDPTest._run exits with the "multi-device" skip.
NO_ACCELERATOR = "no accelerator here (its world size would be 0: no test process, reported as passed)"


def accelerator_count() -> int:
    import torch

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def installed_package() -> str:
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp", "_fully_shard")


def copy_package(tmp: str) -> None:
    shutil.copytree(installed_package(), os.path.join(tmp, PACKAGE), ignore=shutil.ignore_patterns("__pycache__"))


def lay_frames(patch: Patch, tmp: str) -> None:
    for target, frame in patch.frames:
        os.makedirs(os.path.dirname(os.path.join(tmp, target)), exist_ok=True)
        shutil.copy(os.path.join(HERE, frame), os.path.join(tmp, target))


def apply(patch_file: str, tmp: str, *git_apply_args: str) -> bool:
    path = os.path.join(HERE, patch_file)
    check = subprocess.run(["git", "apply", "--check", *git_apply_args, path], cwd=tmp, capture_output=True, text=True)
    if check.returncode != 0:
        print(f"{patch_file} does not apply to this torch's FSDP2 sources ({installed_package()}):\n{check.stderr}")
        return False
    subprocess.run(["git", "apply", *git_apply_args, path], cwd=tmp, check=True)
    return True


# The last "SomeError: ..." line of a failure: for a multi-process test, the rank's
# exception (its first line only says which rank exited) or the timeout.
EXCEPTION_LINE = re.compile(r"^\s*(?:E\s+)?((?:\w+\.)*\w*(?:Error|Exception)\w*: .*)$", re.MULTILINE)


def test_results(junit_xml: str) -> dict[str, str | None]:
    """Each test of a pytest run: None if it passed or was skipped, else its (last) exception line."""
    if not os.path.exists(junit_xml):
        return {}
    results: dict[str, str | None] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        results[name] = None
        for problem in (*case.iter("failure"), *case.iter("error")):
            text = f"{problem.get('message') or ''}\n{problem.text or ''}"
            results[name] = (EXCEPTION_LINE.findall(text) or text.strip().splitlines() or [""])[-1].strip()[:200]
    return results


def test_env(tmp: str | None, patch: Patch | None = None, patched: bool = True) -> dict[str, str]:
    """The environment of a test run against FSDP2 patched in ``tmp`` (the installed one if not
    ``patched``), with ``patch``'s test file (in ``tmp``) for ``test_on_cpu.py``."""
    if patched:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(REDIRECT)
    env = dict(
        os.environ,
        TORCH_FSDP_EXT_DISABLE="1",
        TORCH_FSDP_EXT_TESTS_UPSTREAM_ONLY="1",
        TORCH_FSDP_EXT_TEST_TIMEOUT=str(TEST_TIMEOUT_S),
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
    )
    if patch is not None:
        env["UPSTREAM_TEST_FILE"] = os.path.join(tmp, patch.upstream_test)
        env["UPSTREAM_TEST_RANKS_FOR_DEVICES"] = "1" if patch.ranks_for_devices else "0"
    python_path = (tmp if patched else None, ROOT, os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    return env


def pytest(tests: list[str], env: dict[str, str], junit_xml: str, pytest_args: list[str]) -> dict[str, str | None]:
    """Runs ``tests``; returns each test's result (see ``test_results``)."""
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "--tb=short", f"--junitxml={junit_xml}", *tests, *pytest_args],
        cwd=ROOT, env=env,
    )
    return test_results(junit_xml)


def run_tests(tests: list[str], env: dict[str, str], junit_xml: str, pytest_args: list[str]) -> list[str]:
    """Runs ``tests`` with pytest; returns the failed tests (empty when all passed)."""
    results = pytest(tests, env, junit_xml, pytest_args)
    if not results:
        return ["pytest reported no test"]
    return [f"pytest: {name} ({reason})" for name, reason in results.items() if reason is not None]


def must_fail(results: dict[str, str | None], where: str, error: str | None = None) -> list[str]:
    """The tests of ``results`` that did not fail (with ``error`` if given) on ``where``."""
    for name, reason in results.items():
        print(f"  {name}: {'PASSES' if reason is None else 'fails'} on {where} {f'({reason})' if reason else ''}")
    if not results:
        return [f"no test ran on {where}"]
    return [
        f"{name} does not fail{f' with {error!r}' if error else ''} on {where}"
        for name, reason in results.items()
        if reason is None or (error is not None and error not in reason)
    ]


def check_patch(patch: Patch, pytest_args: list[str]) -> list[str]:
    """Returns what failed (empty when the patch passed)."""
    print(f"\n=== {patch.file}")
    missing = [test for test in patch.project_tests if not os.path.exists(os.path.join(ROOT, test))]
    if missing:
        return [f"project tests missing from this checkout: {', '.join(missing)}"]
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        lay_frames(patch, tmp)
        on_cpu = [os.path.join(HERE, "test_on_cpu.py")]
        failed = []
        if patch.unpatched_error is not None:
            if not apply(patch.file, tmp, "--include=test/*"):
                return ["git apply (its tests)"]
            print(f"its tests on the unpatched FSDP2 ({installed_package()}): each must fail")
            unpatched = pytest(
                on_cpu, test_env(tmp, patch, patched=False), os.path.join(tmp, "unpatched.xml"), ["--tb=no"]
            )
            failed += must_fail(unpatched, "unpatched torch", patch.unpatched_error)
            if not apply(patch.file, tmp, "--exclude=test/*"):
                return [*failed, "git apply (its FSDP2 changes)"]
        elif not apply(patch.file, tmp):
            return ["git apply"]
        env = test_env(tmp, patch)
        where = subprocess.run(
            [sys.executable, "-c", "import torch.distributed.fsdp._fully_shard._fsdp_state as m; print(m.__file__)"],
            env=env, capture_output=True, text=True,
        )
        if where.returncode != 0 or not where.stdout.strip().startswith(tmp):
            return [*failed, f"import from the patched copy: {where.stdout.strip() or where.stderr.strip()[-500:]}"]
        print(f"applies; FSDP2 imported from the patched copy: {where.stdout.strip()}")
        tests = [*on_cpu, *(os.path.join(ROOT, t) for t in patch.project_tests)]
        if accelerator_count() > 0:
            tests.insert(0, env["UPSTREAM_TEST_FILE"])  # as torch's CI runs it
        else:
            print(f"{patch.upstream_test} as torch's harness runs it: not run, {NO_ACCELERATOR}")
        return failed + run_tests(tests, env, os.path.join(tmp, "junit.xml"), pytest_args)


def check_previous_pr2(previous: str, tests: tuple[str, ...]) -> list[str]:
    """The review cases fail against a previous version of PR 2: returns those that did not."""
    print(f"\n=== {previous}: its review's cases must fail")
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        if not apply(previous, tmp):
            return ["git apply"]
        results = pytest(
            [os.path.join(ROOT, REVIEW_CASES_TEST)], test_env(tmp), os.path.join(tmp, "junit.xml"),
            ["--tb=no", "-k", " or ".join(tests)],
        )
        return must_fail(results, previous)


def check_unpatched_equal() -> list[str]:
    """PR 2's review cases on the installed torch: each must pass, as on PR 2."""
    print(f"\n=== the review cases on unpatched torch ({installed_package()}): each must pass")
    with tempfile.TemporaryDirectory() as tmp:
        return run_tests(
            [os.path.join(ROOT, REVIEW_CASES_TEST)], test_env(None, patched=False), os.path.join(tmp, "junit.xml"),
            ["-k", UNPATCHED_EQUAL],
        )


def check_stack() -> list[str]:
    print("\n=== the stack: every patch, in order, on one copy")
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        for patch in PATCHES:
            lay_frames(patch, tmp)
            if not apply(patch.file, tmp):
                return [f"{patch.file} on top of the ones before it"]
    print("applies")
    return []


def report_gloo_exit_abort() -> str:
    """The line of the gloo teardown-abort reproducer, or why it did not run (information only)."""
    script = os.path.join(HERE, GLOO_REPRO)
    if not os.path.exists(script):
        return f"not run: no {GLOO_REPRO}"
    try:
        run = subprocess.run(
            [sys.executable, script, "--runs", str(GLOO_RUNS)], cwd=ROOT, capture_output=True, text=True,
            timeout=GLOO_TIMEOUT_S, env=dict(os.environ, TORCH_FSDP_EXT_DISABLE="1"),
        )
    except subprocess.TimeoutExpired:
        return f"no result within {GLOO_TIMEOUT_S} s"
    lines = [line for line in run.stdout.splitlines() if line.startswith("gloo exit abort:")]
    return lines[-1] if lines else f"exit status {run.returncode}, no result line: {run.stderr.strip()[-300:]}"


def timed(name: str, step, durations: dict[str, float]):
    start = time.monotonic()
    result = step()
    durations[name] = time.monotonic() - start
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, pytest_args = parser.parse_known_args()  # everything else goes to pytest (e.g. -k parity)
    import torch

    if torch.__version__.split("+")[0] != BASE_RELEASE:
        print(f"note: the patches are against torch {BASE_RELEASE}; this is torch {torch.__version__}")
    durations: dict[str, float] = {}
    failures = {
        patch.file: timed(patch.file, lambda patch=patch: check_patch(patch, pytest_args), durations)
        for patch in PATCHES
    }
    for previous, tests in PREVIOUS_PR2.items():
        name = f"{previous} (its review's cases fail)"
        failures[name] = timed(name, lambda previous=previous, tests=tests: check_previous_pr2(previous, tests), durations)
    name = "review cases on unpatched torch (pass)"
    failures[name] = timed(name, check_unpatched_equal, durations)
    failures["stack"] = timed("stack", check_stack, durations)
    print(f"\n=== {GLOO_REPRO}, for information (not a check)")
    gloo = timed(GLOO_REPRO, report_gloo_exit_abort, durations)
    print(gloo)
    print(f"\n=== summary (each multi-process test may take {TEST_TIMEOUT_S} s)")
    for name, failed in failures.items():
        print(f"{name}: {'FAILED' if failed else 'ok'} ({durations[name]:.0f} s)")
        for what in failed:
            print(f"  failed: {what}")
    print(f"{GLOO_REPRO} (information): {gloo} ({durations[GLOO_REPRO]:.0f} s)")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
