"""Prove that each upstream PR alone fixes its failure, without touching the installed torch.

    python tools/upstream/check.py            # on torch 2.15.0, the release the patches are against
    python tools/upstream/check.py -k parity  # extra pytest arguments go to every patched run
    python tools/upstream/check.py --patch pr1-mixed-orig-dtypes.patch  # that patch's step only

For each patch in ``PATCHES``:

1. copies the installed torch's sources the patches change (``SOURCES``: the FSDP2 package
   ``torch/distributed/fsdp/_fully_shard`` and ``torch/utils/checkpoint.py``) into a
   temporary directory, with the upstream test files its test hunks change
   (``Patch.bases``: each the exact text of that file at ``UPSTREAM_COMMIT``, stored here,
   since torch does not ship its tests),
2. checks that the patch applies (``git apply --check``); for a patch with
   ``unpatched_error``, applies only its test hunks first and runs its selected tests on
   the unpatched torch: each must fail with that error,
3. applies the patch and runs, with those modules imported from the patched copy (a
   ``sitecustomize`` there redirects them in every test process) and the plugin disabled:
   the patch's test file as torch's harness runs it (only with an accelerator: see
   ``NO_ACCELERATOR``), the same tests on CPU with gloo (``test_on_cpu.py``), and the
   patch's project tests. Tests of the plugin's own machinery are skipped in that run
   (``plugin_specific`` in test/common.py).

Then:

- ``test_recompute_inputs_on_cpu.py`` on the installed, unpatched torch: the tests it names
  in ``FIXED`` must fail there (PR 2 fixes them), every other one must pass (PR 2 gives
  what unpatched torch gives there);
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
import ast
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
# The installed torch's sources the patches change, relative to torch's repository root
SOURCES = ("torch/distributed/fsdp/_fully_shard", "torch/utils/checkpoint.py")
# The pytorch/pytorch commit whose test files are stored here for the patches' test hunks
UPSTREAM_COMMIT = "003a6c0a80952ae0ecfe7827b7b0d3c0515e4d25"
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
    # file in tools/upstream/ (its text at UPSTREAM_COMMIT) laid there before the patch
    bases: tuple[tuple[str, str], ...] = ()
    # pytest -k expression: the tests of upstream_test that the patch adds (None: all)
    select: str | None = None
    # The error each selected test must fail with on unpatched torch; None: not run
    unpatched_error: str | None = None


MIXED_PRECISION_TEST = "test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py"

# The stack, in order. Project tests: PR 1 has the semantics of dtype_strategy="preserve"
# (test_preserve.py; test_dtype.py tests the plugin's upcast, which the native patch does
# not do); PR 2 replays the root's input move (test_recompute.py, and the CPU version of
# its own tests' scenarios).
PATCHES = (
    Patch(
        "pr1-mixed-orig-dtypes.patch",
        MIXED_PRECISION_TEST,
        ("test/test_preserve.py",),
        ranks_for_devices=True,
        bases=((MIXED_PRECISION_TEST, "upstream_test_fully_shard_mixed_precision.py"),),
        select="test_mixed_orig_dtypes or test_mixed_float8",
        unpatched_error="FSDP expects uniform original parameter dtype",
    ),
    Patch(
        "pr2-recompute-root-input-move.patch",
        "test/distributed/_composable/fsdp/test_fully_shard_recompute_inputs.py",
        ("test/test_recompute.py", "tools/upstream/test_recompute_inputs_on_cpu.py"),
        ranks_for_devices=False,  # its test moves CPU inputs to a real accelerator
    ),
)

# Run on the installed, unpatched torch: its FIXED tests must fail, the others pass
PR2_CPU_TEST = "tools/upstream/test_recompute_inputs_on_cpu.py"

GLOO_REPRO = "gloo_exit_abort_repro.py"
GLOO_RUNS = 3
GLOO_TIMEOUT_S = 300

REDIRECT = '''\
# Written by tools/upstream/check.py: import the patched modules from the copy next to this file.
import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = "torch.distributed.fsdp._fully_shard"
_MODULE = "torch.utils.checkpoint"


class _Patched(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        base = os.path.join(_HERE, *fullname.split("."))
        if fullname == _PACKAGE:  # its submodules follow its __path__, i.e. the patched copy
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(base, "__init__.py"), submodule_search_locations=[base]
            )
        if fullname == _MODULE:
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


sys.meta_path.insert(0, _Patched())
'''


# Note: the PR tests size their world by the accelerator count, as torch's FSDP tests do, so
# on a machine without one MultiProcessTestCase spawns no process and reports a pass; with a
# fixed world size, FSDPTest._run exits with the "multi-device" skip.
NO_ACCELERATOR = "no accelerator here (its world size would be 0: no test process, reported as passed)"


def accelerator_count() -> int:
    import torch

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def installed_torch() -> str:
    import torch

    return os.path.dirname(os.path.dirname(torch.__file__))


def copy_sources(tmp: str) -> None:
    for source in SOURCES:
        target = os.path.join(tmp, source)
        if os.path.isdir(os.path.join(installed_torch(), source)):
            shutil.copytree(
                os.path.join(installed_torch(), source), target, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy(os.path.join(installed_torch(), source), target)


def lay_bases(patch: Patch, tmp: str) -> None:
    for target, base in patch.bases:
        os.makedirs(os.path.dirname(os.path.join(tmp, target)), exist_ok=True)
        shutil.copy(os.path.join(HERE, base), os.path.join(tmp, target))


def apply(patch_file: str, tmp: str, *git_apply_args: str) -> bool:
    path = os.path.join(HERE, patch_file)
    check = subprocess.run(["git", "apply", "--check", *git_apply_args, path], cwd=tmp, capture_output=True, text=True)
    if check.returncode != 0:
        print(f"{patch_file} does not apply to this torch's sources ({installed_torch()}):\n{check.stderr}")
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
    """The environment of a test run against the sources patched in ``tmp`` (the installed ones
    if not ``patched``), with ``patch``'s test file (in ``tmp``) for ``test_on_cpu.py``."""
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
        copy_sources(tmp)
        lay_bases(patch, tmp)
        on_cpu = [os.path.join(HERE, "test_on_cpu.py")]
        on_cpu_args = ["-k", patch.select] if patch.select else []
        failed = []
        if patch.unpatched_error is not None:
            if not apply(patch.file, tmp, "--include=test/*"):
                return ["git apply (its tests)"]
            print(f"its tests on the unpatched torch ({installed_torch()}): each must fail")
            unpatched = pytest(
                on_cpu, test_env(tmp, patch, patched=False), os.path.join(tmp, "unpatched.xml"),
                ["--tb=no", *on_cpu_args],
            )
            failed += must_fail(unpatched, "unpatched torch", patch.unpatched_error)
            if not apply(patch.file, tmp, "--exclude=test/*"):
                return [*failed, "git apply (its torch changes)"]
        elif not apply(patch.file, tmp):
            return ["git apply"]
        env = test_env(tmp, patch)
        where = subprocess.run(
            [
                sys.executable, "-c",
                "import torch.distributed.fsdp._fully_shard._fsdp_state as m, torch.utils.checkpoint as c; "
                "print(m.__file__); print(c.__file__)",
            ],
            env=env, capture_output=True, text=True,
        )
        files = where.stdout.split()
        if where.returncode != 0 or len(files) != 2 or not all(f.startswith(tmp) for f in files):
            return [*failed, f"import from the patched copy: {where.stdout.strip() or where.stderr.strip()[-500:]}"]
        print(f"applies; imported from the patched copy: {', '.join(files)}")
        if accelerator_count() > 0:  # as torch's CI runs it
            failed += run_tests(
                [env["UPSTREAM_TEST_FILE"]], env, os.path.join(tmp, "upstream.xml"), [*on_cpu_args, *pytest_args]
            )
        else:
            print(f"{patch.upstream_test} as torch's harness runs it: not run, {NO_ACCELERATOR}")
        failed += run_tests(on_cpu, env, os.path.join(tmp, "on_cpu.xml"), [*on_cpu_args, *pytest_args])
        tests = [os.path.join(ROOT, t) for t in patch.project_tests]
        return failed + run_tests(tests, env, os.path.join(tmp, "junit.xml"), pytest_args)


def fixed_tests(test_file: str) -> tuple[str, ...]:
    """The names in ``test_file``'s ``FIXED`` tuple (read, not imported: importing it sets up torch)."""
    with open(test_file) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["FIXED"]:
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"no FIXED in {test_file}")


def check_pr2_cases_unpatched() -> list[str]:
    """PR 2's CPU tests on the installed torch: those in FIXED must fail, the others pass."""
    fixed_names = fixed_tests(os.path.join(ROOT, PR2_CPU_TEST))
    print(f"\n=== {PR2_CPU_TEST} on unpatched torch ({installed_torch()}): {', '.join(fixed_names)} fail, the others pass")
    with tempfile.TemporaryDirectory() as tmp:
        results = pytest(
            [os.path.join(ROOT, PR2_CPU_TEST)], test_env(None, patched=False), os.path.join(tmp, "junit.xml"),
            ["--tb=line"],
        )
    fixed = {name: reason for name, reason in results.items() if name.rsplit("::", 1)[-1] in fixed_names}
    failed = must_fail(fixed, "unpatched torch")
    if len(fixed) != len(fixed_names):
        failed.append(f"ran {len(fixed)} of the {len(fixed_names)} tests in FIXED")
    failed += [f"pytest: {name} ({reason})" for name, reason in results.items() if name not in fixed and reason]
    return failed


def check_stack() -> list[str]:
    print("\n=== the stack: every patch, in order, on one copy")
    with tempfile.TemporaryDirectory() as tmp:
        copy_sources(tmp)
        for patch in PATCHES:
            lay_bases(patch, tmp)
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
    parser.add_argument("--patch", choices=[patch.file for patch in PATCHES], help="check only this patch's step")
    args, pytest_args = parser.parse_known_args()  # everything else goes to pytest (e.g. -k parity)
    import torch

    if torch.__version__.split("+")[0] != BASE_RELEASE:
        print(f"note: the patches are against torch {BASE_RELEASE}; this is torch {torch.__version__}")
    durations: dict[str, float] = {}
    failures = {
        patch.file: timed(patch.file, lambda patch=patch: check_patch(patch, pytest_args), durations)
        for patch in PATCHES
        if args.patch in (None, patch.file)
    }
    gloo = None
    if args.patch is None:
        name = "PR 2's CPU tests on unpatched torch (FIXED fail, the others pass)"
        failures[name] = timed(name, check_pr2_cases_unpatched, durations)
        failures["stack"] = timed("stack", check_stack, durations)
        print(f"\n=== {GLOO_REPRO}, for information (not a check)")
        gloo = timed(GLOO_REPRO, report_gloo_exit_abort, durations)
        print(gloo)
    print(f"\n=== summary (each multi-process test may take {TEST_TIMEOUT_S} s)")
    for name, failed in failures.items():
        print(f"{name}: {'FAILED' if failed else 'ok'} ({durations[name]:.0f} s)")
        for what in failed:
            print(f"  failed: {what}")
    if gloo is not None:
        print(f"{GLOO_REPRO} (information): {gloo} ({durations[GLOO_REPRO]:.0f} s)")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
