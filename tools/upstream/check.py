"""Prove that each upstream PR alone fixes its failure, without touching the installed torch.

    python tools/upstream/check.py            # on torch 2.15.0, the release the patches are against
    python tools/upstream/check.py -k parity  # extra pytest arguments go to every run
    python tools/upstream/check.py --upstream-tree DIR  # also PR 1's version for upstream 010ae4a8

For each patch in ``PATCHES``:

1. copies the installed torch's FSDP2 package (``torch/distributed/fsdp/_fully_shard``)
   into a temporary directory,
2. checks that the patch applies (``git apply --check``) and applies it there (the
   patch also adds its test file under ``test/distributed/_composable/fsdp/``),
3. runs, with FSDP2 imported from the patched copy (a ``sitecustomize`` there redirects
   ``torch.distributed.fsdp._fully_shard`` in every test process) and the plugin
   disabled: the patch's own test file as torch's harness runs it (only with an
   accelerator: see ``NO_ACCELERATOR``), the same test classes on CPU with gloo
   (``test_on_cpu.py``), and the patch's project tests. Tests of the plugin's own
   machinery are skipped in that run (``plugin_specific`` in test/common.py).

With ``--upstream-tree``, it also runs PR 1's version for the upstream sources
(``UPSTREAM_PR1``): on a copy of those sources, ``test_train_parity`` must fail unpatched
with the original-dtype assertion and the whole test file must pass patched.

Then it applies PR 2's previous version (``PREVIOUS_PR2``) to a fresh copy and runs the review
cases 1(a)-(c) and 2 of ``test_recompute_inputs_on_cpu.py`` there: each must fail (they pass on PR 2).
Finally it checks that the patches also apply one after the other (the stack).
Exits non-zero if any step of any patch fails; the summary names each failed step and
test (with its exception line, e.g. a rank's assertion or a timeout) and how long each step took.

Timeouts are explicit and generous, since CI machines may be loaded: each
multi-process test (all subtests of a torch-style test run in one) may take
``TEST_TIMEOUT_S`` before its processes are killed and it fails as timed out.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
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
# all its subtests takes about 2 minutes on a loaded 2-core machine).
TEST_TIMEOUT_S = 900


class Patch(NamedTuple):
    file: str  # in tools/upstream/
    upstream_test: str  # the test file the patch adds, relative to torch's repository root
    project_tests: tuple[str, ...]  # relative to this repository's root
    # Whether the upstream test's devices only stand for ranks: then test_on_cpu.py runs
    # its skip_if_lt_x_gpu(n) tests with n gloo ranks on CPU
    ranks_for_devices: bool


# The stack, in order. Project tests: PR 1 has the semantics of dtype_strategy="preserve"
# (test_preserve.py; test_dtype.py tests the plugin's upcast, which the native patch does
# not do); PR 2 replays the root's input move (test_recompute.py, and the CPU version of
# its own test's scenarios).
PATCHES = (
    Patch(
        "pr1-mixed-orig-dtypes.patch",
        "test/distributed/_composable/fsdp/test_fully_shard_mixed_dtype.py",
        ("test/test_preserve.py",),
        ranks_for_devices=True,
    ),
    Patch(
        "pr2-recompute-root-input-move.patch",
        "test/distributed/_composable/fsdp/test_fully_shard_recompute_inputs.py",
        ("test/test_recompute.py", "tools/upstream/test_recompute_inputs_on_cpu.py"),
        ranks_for_devices=False,  # its test moves CPU inputs to a real accelerator
    ),
)

# PR 1 against the newest upstream sources the reference index holds (pytorch/pytorch at
# UPSTREAM_COMMIT; there ``foreach_reduce`` still takes ``orig_dtype`` and asserts one gradient
# dtype, which v2.15.0 replaced). Only the three files the patch changes are stored at that
# commit, so the copy it runs against is v2.12.1's package (the closest release to them) with
# those three files over it, on the installed torch (2.15.0: it has
# ``fsdp::chunk_cat_mixed_dtype``, which the patch reuses). They are not in this repository:
# ``--upstream-tree DIR`` names a directory holding them (``UPSTREAM_FILES`` has their
# hashes); without it this step is reported as not run.
UPSTREAM_PR1 = Patch(
    "pr1-mixed-orig-dtypes-upstream.patch",
    "test/distributed/_composable/fsdp/test_fully_shard_mixed_dtype.py",
    (),
    ranks_for_devices=True,
)
UPSTREAM_COMMIT = "010ae4a89516fa3be548ab16dff711414ec12d0b"
UPSTREAM_FILES = {
    "_fsdp_collectives.py": "9014bf2174765b492040af86b0b3b4bd6e55b8ddac7e0ff8d0eac2b2a9fba35c",
    "_fsdp_param.py": "ef0d91a4734eb11353bb52108814c4e8534f6082415c73d2823692bf166ccbcd",
    "_fsdp_param_group.py": "640f5a81c28ea88a7e76ca896b672390157a7c7701028ef6dc271b85bd3f1687",
}
UPSTREAM_REST_RELEASE = "2.12.1"  # .ci/run's venv for it holds the package
# torch 2.15.0's torch.distributed.fsdp imports this from the package; v2.12.1's lacks it
UPSTREAM_REST_STAND_IN = (
    "\n\nclass GradientReductionHandle:  # written by check.py for torch 2.15.0's imports\n"
    "    pass\n"
)
# The unpatched upstream copy must fail these with the original-dtype assertion
UPSTREAM_UNPATCHED_CASES = "test_train_parity and not bf16"

# PR 2's previous design (v3), kept to show that the cases its review found are the new
# tests' failures: each of these (cases 1(a)-(c) and 2) must fail against it and pass against
# PR 2. Case 2 counts in its flat form (only the root sharded), where v3 trains on silently
# with another mask; with the blocks sharded too, v3 raises for it (loud, as PR 2 must be).
PREVIOUS_PR2 = "pr2-recompute-root-input-move-v3.patch"
REVIEW_CASES_TEST = "tools/upstream/test_recompute_inputs_on_cpu.py"
REVIEW_CASE_PREFIXES = ("review_1", "review_2_root")
REVIEW_CASES = "test_review_case and (" + " or ".join(REVIEW_CASE_PREFIXES) + ")"

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


def apply(patch_file: str, tmp: str) -> bool:
    path = os.path.join(HERE, patch_file)
    check = subprocess.run(["git", "apply", "--check", path], cwd=tmp, capture_output=True, text=True)
    if check.returncode != 0:
        print(f"{patch_file} does not apply to this torch's FSDP2 sources ({installed_package()}):\n{check.stderr}")
        return False
    subprocess.run(["git", "apply", path], cwd=tmp, check=True)
    return True


# The last "SomeError: ..." line of a failure: for a multi-process test, the rank's
# exception (its first line only says which rank exited) or the timeout.
EXCEPTION_LINE = re.compile(r"^\s*(?:E\s+)?((?:\w+\.)*\w*(?:Error|Exception)\w*: .*)$", re.MULTILINE)


def failed_tests(junit_xml: str) -> list[str]:
    """The failed tests of a pytest run, each with its (last) exception line."""
    if not os.path.exists(junit_xml):
        return []
    failed = []
    for case in ET.parse(junit_xml).iter("testcase"):
        for problem in (*case.iter("failure"), *case.iter("error")):
            text = f"{problem.get('message') or ''}\n{problem.text or ''}"
            reason = (EXCEPTION_LINE.findall(text) or text.strip().splitlines() or [""])[-1]
            failed.append(f"{case.get('classname')}::{case.get('name')} ({reason.strip()[:200]})")
    return failed


def patched_env(patch: Patch, tmp: str) -> dict[str, str]:
    """The environment of a test run against FSDP2 patched with ``patch`` in ``tmp``."""
    with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
        f.write(REDIRECT)
    env = dict(
        os.environ,
        TORCH_FSDP_EXT_DISABLE="1",
        TORCH_FSDP_EXT_TESTS_UPSTREAM_ONLY="1",
        TORCH_FSDP_EXT_TEST_TIMEOUT=str(TEST_TIMEOUT_S),
        UPSTREAM_TEST_FILE=os.path.join(tmp, patch.upstream_test),
        UPSTREAM_TEST_RANKS_FOR_DEVICES="1" if patch.ranks_for_devices else "0",
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def run_tests(tests: list[str], env: dict[str, str], junit_xml: str, pytest_args: list[str]) -> list[str]:
    """Runs ``tests`` with pytest; returns the failed tests (empty when all passed)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit_xml}", *tests, *pytest_args],
        cwd=ROOT, env=env,
    )
    if run.returncode == 0:
        return []
    return [f"pytest: {test}" for test in failed_tests(junit_xml)] or [
        f"pytest exited with status {run.returncode} and reported no failed test"
    ]


def check_patch(patch: Patch, pytest_args: list[str]) -> list[str]:
    """Returns what failed (empty when the patch passed)."""
    print(f"\n=== {patch.file}")
    missing = [test for test in patch.project_tests if not os.path.exists(os.path.join(ROOT, test))]
    if missing:
        return [f"project tests missing from this checkout: {', '.join(missing)}"]
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        if not apply(patch.file, tmp):
            return ["git apply"]
        env = patched_env(patch, tmp)
        upstream_test = env["UPSTREAM_TEST_FILE"]
        where = subprocess.run(
            [sys.executable, "-c", "import torch.distributed.fsdp._fully_shard._fsdp_state as m; print(m.__file__)"],
            env=env, capture_output=True, text=True,
        )
        if where.returncode != 0 or not where.stdout.strip().startswith(tmp):
            return [f"import from the patched copy: {where.stdout.strip() or where.stderr.strip()[-500:]}"]
        print(f"applies; FSDP2 imported from the patched copy: {where.stdout.strip()}")
        tests = [os.path.join(HERE, "test_on_cpu.py"), *(os.path.join(ROOT, t) for t in patch.project_tests)]
        if accelerator_count() > 0:
            tests.insert(0, upstream_test)  # as torch's CI runs it
        else:
            print(f"{patch.upstream_test} as torch's harness runs it: not run, {NO_ACCELERATOR}")
        return run_tests(tests, env, os.path.join(tmp, "junit.xml"), pytest_args)


def release_package(release: str) -> str | None:
    cache = os.environ.get("TORCH_FSDP_EXT_CACHE", os.path.expanduser("~/.cache/torch_fsdp_ext"))
    found = glob.glob(os.path.join(cache, f"venv-{release}", "lib", "python3*", "site-packages", PACKAGE))
    return found[0] if found else None


def copy_upstream_package(upstream_tree: str, tmp: str) -> str | None:
    """Builds the upstream copy in ``tmp``; returns why it cannot be built, or None."""
    rest = release_package(UPSTREAM_REST_RELEASE)
    if rest is None:
        return f"no torch {UPSTREAM_REST_RELEASE} venv under the cache (.ci/run makes it)"
    target = os.path.join(tmp, PACKAGE)
    shutil.copytree(rest, target, ignore=shutil.ignore_patterns("__pycache__"))
    for name, sha256 in UPSTREAM_FILES.items():
        path = os.path.join(upstream_tree, name)
        if not os.path.exists(path):
            return f"{path} is missing"
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != sha256:
                return f"{path} is not {name} at {UPSTREAM_COMMIT} (sha256 differs)"
        shutil.copy(path, target)
    with open(os.path.join(target, "__init__.py"), "a") as f:
        f.write(UPSTREAM_REST_STAND_IN)
    return None


def check_upstream_pr1(upstream_tree: str | None, pytest_args: list[str]) -> list[str] | None:
    """PR 1 on the upstream sources: fails unpatched, passes patched. None when not run."""
    patch = UPSTREAM_PR1
    print(f"\n=== {patch.file}: against pytorch/pytorch {UPSTREAM_COMMIT[:8]}")
    if upstream_tree is None:
        print(f"not run: no --upstream-tree (the files of {UPSTREAM_COMMIT[:8]} it changes are not shipped here)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        why_not = copy_upstream_package(upstream_tree, tmp)
        if why_not:
            return [f"upstream copy: {why_not}"]
        subprocess.run(["git", "apply", "--include=test/*", os.path.join(HERE, patch.file)], cwd=tmp, check=True)
        env = patched_env(patch, tmp)
        junit_xml = os.path.join(tmp, "unpatched.xml")
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=no", f"--junitxml={junit_xml}",
             os.path.join(HERE, "test_on_cpu.py"), "-k", UPSTREAM_UNPATCHED_CASES, *pytest_args],
            cwd=ROOT, env=env,
        )
        unpatched = list(ET.parse(junit_xml).iter("testcase")) if os.path.exists(junit_xml) else []
        reasons = failed_tests(junit_xml)
        print(f"unpatched: {len(reasons)} of {len(unpatched)} fail: {sorted({r[r.find(' ('):] for r in reasons})}")
        if not unpatched or len(reasons) != len(unpatched) or not all(
            "uniform original parameter dtype" in reason for reason in reasons
        ):
            return ["the unpatched upstream copy does not fail with the original-dtype assertion"]
        subprocess.run(["git", "apply", "--exclude=test/*", os.path.join(HERE, patch.file)], cwd=tmp, check=True)
        return run_tests([os.path.join(HERE, "test_on_cpu.py")], env, os.path.join(tmp, "junit.xml"), pytest_args)


def check_previous_pr2(pytest_args: list[str]) -> list[str]:
    """The review cases fail against PR 2's previous design: returns those that did not."""
    print(f"\n=== {PREVIOUS_PR2}: the review cases must fail")
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        if not apply(PREVIOUS_PR2, tmp):
            return ["git apply"]
        junit_xml = os.path.join(tmp, "junit.xml")
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=no", f"--junitxml={junit_xml}",
             os.path.join(ROOT, REVIEW_CASES_TEST),
             "-k", REVIEW_CASES, *pytest_args],
            cwd=ROOT, env=patched_env(PATCHES[1]._replace(file=PREVIOUS_PR2), tmp),
        )
        if not os.path.exists(junit_xml):
            return ["pytest wrote no report"]
        cases = [
            case for case in ET.parse(junit_xml).iter("testcase")
            if any(prefix in case.get("name", "") for prefix in REVIEW_CASE_PREFIXES)
        ]
        failed = {case.get("name") for case in cases if any(True for _ in (*case.iter("failure"), *case.iter("error")))}
        reasons = failed_tests(junit_xml)
        for case in cases:
            name = case.get("name")
            reason = next((r for r in reasons if f"::{name} (" in r), "")
            print(f"  {name}: {'fails' if name in failed else 'PASSES'} on {PREVIOUS_PR2} {reason[reason.find(' ('):]}")
        if not cases:
            return [f"no {REVIEW_CASES} ran"]
        return [f"passes on {PREVIOUS_PR2}: {case.get('name')}" for case in cases if case.get("name") not in failed]


def check_stack() -> list[str]:
    print("\n=== the stack: every patch, in order, on one copy")
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        for patch in PATCHES:
            if not apply(patch.file, tmp):
                return [f"{patch.file} on top of the ones before it"]
    print("applies")
    return []


def timed(name: str, step, durations: dict[str, float]):
    start = time.monotonic()
    failed = step()
    durations[name] = time.monotonic() - start
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream-tree", help=f"a directory holding {', '.join(UPSTREAM_FILES)} at {UPSTREAM_COMMIT}")
    args, pytest_args = parser.parse_known_args()  # everything else goes to pytest (e.g. -k parity)
    import torch

    if torch.__version__.split("+")[0] != BASE_RELEASE:
        print(f"note: the patches are against torch {BASE_RELEASE}; this is torch {torch.__version__}")
    durations: dict[str, float] = {}
    failures = {
        patch.file: timed(patch.file, lambda patch=patch: check_patch(patch, pytest_args), durations)
        for patch in PATCHES
    }
    not_run = []
    upstream = timed(UPSTREAM_PR1.file, lambda: check_upstream_pr1(args.upstream_tree, pytest_args), durations)
    if upstream is None:
        not_run.append(UPSTREAM_PR1.file)
    else:
        failures[UPSTREAM_PR1.file] = upstream
    failures[f"{PREVIOUS_PR2} (review cases fail)"] = timed(
        f"{PREVIOUS_PR2} (review cases fail)", lambda: check_previous_pr2(pytest_args), durations
    )
    failures["stack"] = timed("stack", check_stack, durations)
    print(f"\n=== summary (each multi-process test may take {TEST_TIMEOUT_S} s)")
    for name, failed in failures.items():
        print(f"{name}: {'FAILED' if failed else 'ok'} ({durations[name]:.0f} s)")
        for what in failed:
            print(f"  failed: {what}")
    for name in not_run:
        print(f"{name}: not run (no --upstream-tree)")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
