"""Prove that each upstream PR alone fixes its failure, and the stack, without touching the installed torch.

    python tools/upstream/check.py            # on torch 2.15.0, the release the patches are against
    python tools/upstream/check.py --patch pr2a-checkpoint-current-device-rng.patch  # one step (or: stack, rehearsal)
    python tools/upstream/check.py --gpu      # only what needs an accelerator (gpu_check.sh runs it)
    python tools/upstream/check.py -x         # other arguments go to every pytest run of the patches

The patches (``PATCHES``; each touches its own files, so they apply in any order):

- PR 1, ``pr1-mixed-orig-dtypes.patch``: FSDP2 groups with mixed original dtypes; its tests go
  into torch's ``test_fully_shard_mixed_precision.py``;
- PR 2a, ``pr2a-checkpoint-current-device-rng.patch``: checkpoint restores the current
  accelerator's RNG state for regions whose tensor arguments are not on it; tests in
  ``test/test_utils.py``, the RNG paragraph of ``docs/source/checkpoint.md``;
- PR 2b, ``pr2b-fsdp-recompute-input-move.patch``: FSDP2 replays the root's input move in
  recomputation and keeps nested inputs where they are; a new test file. Stacked on 2a.

For each patch alone:

1. copies the installed torch's sources the patches change (``SOURCES``) into a temporary
   directory, with the upstream test files its test hunks change (``Patch.bases``: each the
   exact text of that file at an upstream commit, stored here, since torch does not ship its
   tests), and checks that the patch applies (``git apply --check``);
2. PR 1: applies its test hunks alone and runs its new tests on the unpatched torch (each must
   fail with ``Patch.unpatched_error``), then applies the rest;
3. runs, with those modules imported from the patched copy (a ``sitecustomize`` there redirects
   them in every test process) and the plugin disabled: its tests as torch's harness runs them
   where there is an accelerator (2b only on the stack); PR 1's whole test file on CPU with
   gloo ranks (``test_on_cpu.py``), where a failing test must fail on unpatched torch too (it
   is rerun there); PR 2a's ``TestCheckpoint``; PR 2b's test file (it skips without an
   accelerator); and, for 2a and 2b, the CPU scenarios with a stand-in accelerator
   (``test_recompute_inputs_on_cpu.py``; the tests needing the other patch skip).

Then the stand-in scenarios on the installed, unpatched torch (the tests in their ``NEEDS`` must
fail, the others pass); the stack: all patches on one copy, the stand-in scenarios and the
project tests ``STACK_PROJECT_TESTS``; the rehearsal: on the stack, the torch-style tests the
stack adds, with the GPU skip lifted on CPU, ``Patch.rehearsal_runs`` times in a row (see
``check_rehearsal`` for what it cannot stand in for); and, for information only (never a
failure), torch's gloo teardown abort, counted by ``gloo_exit_abort_repro.py``.

Exits non-zero if any step fails; the summary names each failed step and test (with its
exception line, e.g. a rank's assertion or a timeout) and how long each step took, then
prints each failed test's report, and the end of the output of any pytest run that left no
report. Each multi-process test may take ``TEST_TIMEOUT_S``, each pytest run
``RUN_TIMEOUT_S`` (then it is killed with its ranks and fails); a rank that dies ends its
test at once (``rank_exit.py``).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The installed torch's sources the patches change, relative to torch's repository root
SOURCES = ("torch/distributed/fsdp/_fully_shard", "torch/utils/checkpoint.py")
# The pytorch/pytorch commits of the files stored here for the patches' hunks outside torch's package
UPSTREAM_TEST_COMMITS = {
    "upstream_test_fully_shard_mixed_precision.py": "003a6c0a80952ae0ecfe7827b7b0d3c0515e4d25",
    "upstream_test_utils.py": "0025348e03d0307b815c0043b702e2a64c2ef752",
    "upstream_checkpoint.md": "05382727fd08ac518afece33a69e4bb72c2d2cab",
}
BASE_RELEASE = "2.15.0"
# Seconds one multi-process test may run (torch's default is 300; a torch-style test with
# all its subtests takes about a minute on a loaded 2-core machine).
TEST_TIMEOUT_S = 900
# Seconds one pytest run may take before it is killed (and fails): a hang is reported, not waited on
RUN_TIMEOUT_S = 2400


class Patch(NamedTuple):
    name: str  # as the summary names it
    file: str  # in tools/upstream/
    # Test files the patch changes or adds, relative to torch's repository root; the first is
    # run as torch's harness runs it where there is an accelerator
    upstream_tests: tuple[str, ...]
    # Files the patch changes that torch does not ship (tests, docs), each with the file in
    # tools/upstream/ (its text at an upstream commit) laid there before the patch
    bases: tuple[tuple[str, str], ...] = ()
    # The tests the patch adds, as a pytest -k expression
    new_tests: str | None = None
    # The error each new test must fail with on unpatched torch (its test hunks alone)
    unpatched_error: str | None = None
    # test_on_cpu.py runs the first upstream test file on CPU with gloo ranks (FSDPTest
    # classes whose devices only stand for ranks), all of it, patched; a test failing there
    # is rerun on unpatched torch (test hunks alone), where it must fail too
    on_cpu_whole_file: bool = False
    # The upstream test file run on CPU as it is (pytest -k), patched
    on_cpu_k: str | None = None
    # Its name in test_recompute_inputs_on_cpu.py's NEEDS ("2a", "2b"); None: not run there
    stand_in: str | None = None
    # Whether its tests pass under torch's harness with this patch alone (False: only on the stack)
    harness_alone: bool = True
    # Times in a row the rehearsal runs its new tests (or its whole new test file) on the stack
    # with the GPU skip lifted; 0: not rehearsed (see check_rehearsal)
    rehearsal_runs: int = 0


MIXED_PRECISION_TEST = "test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py"
UTILS_TEST = "test/test_utils.py"
RECOMPUTE_INPUTS_TEST = "test/distributed/_composable/fsdp/test_fully_shard_recompute_inputs.py"

# Each patch alone on the installed torch's sources, then the stack, in this order.
PATCHES = (
    Patch(
        "PR 1",
        "pr1-mixed-orig-dtypes.patch",
        (MIXED_PRECISION_TEST,),
        bases=((MIXED_PRECISION_TEST, "upstream_test_fully_shard_mixed_precision.py"),),
        new_tests="test_mixed_orig_dtypes or test_mixed_float8",
        unpatched_error="FSDP expects uniform original parameter dtype",
        on_cpu_whole_file=True,
        rehearsal_runs=2,  # gloo processes: no generator shared between ranks
    ),
    Patch(
        "PR 2a",
        "pr2a-checkpoint-current-device-rng.patch",
        (UTILS_TEST,),
        bases=((UTILS_TEST, "upstream_test_utils.py"), ("docs/source/checkpoint.md", "upstream_checkpoint.md")),
        new_tests="test_checkpoint_rng_gpu_cpu_args or test_checkpoint_rng_gpu_state_reads",
        on_cpu_k="TestCheckpoint",
        stand_in="2a",
    ),
    Patch(
        "PR 2b",
        "pr2b-fsdp-recompute-input-move.patch",
        (RECOMPUTE_INPUTS_TEST,),
        on_cpu_k="TestFullyShardRecomputeInputs",  # collects and skips: it needs an accelerator
        stand_in="2b",
        harness_alone=False,  # its test with dropout needs PR 2a on a GPU
        rehearsal_runs=5,  # threads: ranks share the process's generators
    ),
)
# Project tests run against the stack: PR 1 has the semantics of dtype_strategy="preserve"
# (test_preserve.py; test_dtype.py tests the plugin's upcast, which PR 1 does not do);
# test_recompute.py's checkpoint flavours with the recompute replay of PR 2a + 2b.
STACK_PROJECT_TESTS = ("test/test_preserve.py", "test/test_recompute.py")

# PR 2a's and 2b's scenarios on CPU with a stand-in accelerator
STAND_IN_TEST = "tools/upstream/test_recompute_inputs_on_cpu.py"

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


# What each failed test printed (its report in pytest's JUnit file), or a pytest run that ended
# without a report (its output's last lines; always shown): shown after the summary, OUTPUT_CHARS
# of each, for the tests that a failed step names (not those that had to fail on unpatched torch).
FAILURE_OUTPUT: list[tuple[str, str, bool]] = []
OUTPUT_CHARS = 4000


def test_results(junit_xml: str) -> dict[str, str | None]:
    """Each test of a pytest run by name: None if it passed or was skipped, else its (last) exception
    line; each failure's report goes to FAILURE_OUTPUT."""
    if not os.path.exists(junit_xml):
        return {}
    results: dict[str, str | None] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        name = case.get("name")
        results[name] = None
        for problem in (*case.iter("failure"), *case.iter("error")):
            text = f"{problem.get('message') or ''}\n{problem.text or ''}"
            results[name] = (EXCEPTION_LINE.findall(text) or text.strip().splitlines() or [""])[-1].strip()[:200]
            FAILURE_OUTPUT.append((name, text.strip()[-OUTPUT_CHARS:], False))
    return results


def test_env(tmp: str | None, applied: tuple[str, ...] | None = None, test_file: str | None = None) -> dict[str, str]:
    """The environment of a test run against the sources patched in ``tmp`` (the installed ones if
    ``tmp`` is None); ``applied``: the stand-in test's patch names; ``test_file``: test_on_cpu.py's."""
    if tmp is not None:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(REDIRECT)
    env = dict(
        os.environ,
        TORCH_FSDP_EXT_DISABLE="1",
        TORCH_FSDP_EXT_TESTS_UPSTREAM_ONLY="1",
        TORCH_FSDP_EXT_TEST_TIMEOUT=str(TEST_TIMEOUT_S),
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
        UPSTREAM_TEST_RANKS_FOR_DEVICES="1",
    )
    if applied is not None:
        env["UPSTREAM_PATCHES_APPLIED"] = ",".join(applied)
    if test_file is not None:
        env["UPSTREAM_TEST_FILE"] = test_file
    python_path = (tmp, ROOT, os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    return env


def pytest(tests: list[str], env: dict[str, str], junit_xml: str, pytest_args: list[str]) -> dict[str, str | None]:
    """Runs ``tests``; returns each test's result (see ``test_results``). Its output is printed
    and kept: a run that ends without a report (killed, aborted, or past RUN_TIMEOUT_S, when
    its process group is killed) leaves no result, and its output's end goes to FAILURE_OUTPUT."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "--tb=short", f"--junitxml={junit_xml}", *tests]
    # Note: its own session, so that a run past its time is killed with its rank processes
    run = subprocess.Popen(
        [*command, *pytest_args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    timer = threading.Timer(RUN_TIMEOUT_S, os.killpg, (run.pid, signal.SIGKILL))
    timer.start()
    output: list[str] = []
    for line in run.stdout:
        print(line, end="", flush=True)
        output.append(line)
    status = run.wait()
    timer.cancel()
    results = test_results(junit_xml)
    if not results:
        ended = f"killed after {RUN_TIMEOUT_S} s" if status == -signal.SIGKILL else f"exit status {status}"
        tail = "".join(output)[-OUTPUT_CHARS:]
        FAILURE_OUTPUT.append((f"pytest {' '.join(os.path.basename(t) for t in tests)} ({ended})", tail, True))
    return results


def failed_tests(results: dict[str, str | None], what: str) -> list[str]:
    """The failed tests of ``results`` (empty when all passed)."""
    if not results:
        return [f"{what}: pytest reported no test"]
    return [f"{what}: {name} ({reason})" for name, reason in results.items() if reason is not None]


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


def is_new_test(patch: Patch, name: str) -> bool:
    return patch.new_tests is not None and any(t.strip() in name for t in patch.new_tests.split(" or "))


def check_imports_patched(tmp: str, env: dict[str, str]) -> list[str]:
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
        return [f"import from the patched copy: {where.stdout.strip() or where.stderr.strip()[-500:]}"]
    print(f"imported from the patched copy: {', '.join(files)}")
    return []


# New tests that skip on CPU with gloo (the file's NCCL guards): they neither fail unpatched
# nor run patched here; the GPU script runs them.
SKIPPED_ON_CPU = {"pr1-mixed-orig-dtypes.patch": ("test_mixed_orig_dtypes_bf16_reduce",)}


def compare_whole_file(patch: Patch, patched: dict, rerun_unpatched) -> list[str]:
    """The whole upstream test file on CPU with the patch: no test may fail unless it fails
    on unpatched torch too (``rerun_unpatched(names)`` runs those there, with the new tests)."""
    failing = [name for name, reason in patched.items() if reason is not None]
    if not failing:
        return []
    unpatched = rerun_unpatched(failing)
    failed = []
    for name in failing:
        if not is_new_test(patch, name) and unpatched.get(name) is not None:
            print(f"  {name}: fails on unpatched {BASE_RELEASE} too ({unpatched[name]})")
        else:
            failed.append(f"{name} fails with the patch ({patched[name]})")
    return failed


def check_patch(patch: Patch, pytest_args: list[str]) -> list[str]:
    """One patch alone on the installed torch's sources; returns what failed."""
    print(f"\n=== {patch.name}: {patch.file}")
    on_cpu = [os.path.join(HERE, "test_on_cpu.py")]
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        copy_sources(tmp)
        lay_bases(patch, tmp)
        test_file = os.path.join(tmp, patch.upstream_tests[0])
        unpatched_env = test_env(None, test_file=test_file)
        if patch.unpatched_error is not None:
            if not apply(patch.file, tmp, "--include=test/*"):
                return ["git apply (its tests)"]
            print(f"its new tests on unpatched torch ({installed_torch()}): each must fail")
            unpatched = pytest(
                on_cpu, unpatched_env, os.path.join(tmp, "unpatched.xml"), ["--tb=line", "-k", patch.new_tests]
            )
            skipped = SKIPPED_ON_CPU.get(patch.file, ())
            unpatched = {name: reason for name, reason in unpatched.items() if name not in skipped}
            failed += must_fail(unpatched, "unpatched torch", patch.unpatched_error)
            if not apply(patch.file, tmp, "--exclude=test/*"):
                return [*failed, "git apply (its torch changes)"]
        elif not apply(patch.file, tmp):
            return ["git apply"]
        env = test_env(tmp, applied=(patch.stand_in,) if patch.stand_in else None, test_file=test_file)
        failed += check_imports_patched(tmp, env)
        if failed:
            return failed
        if accelerator_count() > 0 and patch.harness_alone:
            failed += run_harness(patch, test_file, env, tmp, pytest_args)
        else:
            print(f"{patch.upstream_tests[0]} as torch's harness runs it: not run here (see --gpu)")
        if patch.on_cpu_whole_file:
            print(f"the whole {patch.upstream_tests[0]} on CPU, patched")
            patched = pytest(on_cpu, env, os.path.join(tmp, "on_cpu.xml"), ["--tb=short", *pytest_args])
            print(f"  {len(patched)} tests, {sum(r is None for r in patched.values())} passed or skipped")
            if not patched:
                failed.append("the whole file on CPU: pytest reported no test")

            def rerun_unpatched(names: list[str]) -> dict[str, str | None]:
                print(f"  on unpatched torch: {', '.join(names)}")
                k = " or ".join(names)
                return pytest(on_cpu, unpatched_env, os.path.join(tmp, "rerun.xml"), ["--tb=line", "-k", k])

            failed += compare_whole_file(patch, patched, rerun_unpatched)
        if patch.on_cpu_k:
            results = pytest([test_file], env, os.path.join(tmp, "k.xml"), ["-k", patch.on_cpu_k, *pytest_args])
            failed += failed_tests(results, f"{patch.upstream_tests[0]} -k {patch.on_cpu_k}")
        if patch.stand_in:
            results = pytest([os.path.join(ROOT, STAND_IN_TEST)], env, os.path.join(tmp, "stand_in.xml"), pytest_args)
            failed += failed_tests(results, STAND_IN_TEST)
    return failed


def run_harness(patch: Patch, test_file: str, env: dict[str, str], tmp: str, pytest_args: list[str]) -> list[str]:
    """``patch``'s tests as torch's CI runs them (FSDP tests skip with fewer devices than they need)."""
    k = ["-k", patch.new_tests] if patch.new_tests else []
    print(f"{patch.upstream_tests[0]} {' '.join(k)} under torch's harness ({accelerator_count()} accelerators)")
    results = pytest([test_file], env, os.path.join(tmp, f"harness_{patch.stand_in}.xml"), [*k, *pytest_args])
    return failed_tests(results, f"{patch.name} under torch's harness")


def check_gpu(pytest_args: list[str]) -> list[str]:
    """What needs an accelerator: PR 2a's new tests fail on unpatched torch; on the stack, each
    patch's tests under torch's harness. With 2 or more devices, PR 1's whole test file (NCCL):
    a test failing there is rerun on unpatched torch (test hunks alone), where it must fail too."""
    if accelerator_count() == 0:
        return ["no accelerator here"]
    pr1, pr2a = PATCHES[0], next(p for p in PATCHES if p.stand_in == "2a")
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as unpatched_tmp, tempfile.TemporaryDirectory() as tmp:
        copy_sources(unpatched_tmp)
        for patch in (pr1, pr2a):
            lay_bases(patch, unpatched_tmp)
            if not apply(patch.file, unpatched_tmp, "--include=test/*"):
                return [f"{patch.file}: git apply (its tests)"]
        print(f"\n=== {pr2a.name}'s new tests on unpatched torch ({installed_torch()}): each must fail")
        results = pytest(
            [os.path.join(unpatched_tmp, pr2a.upstream_tests[0])], test_env(None),
            os.path.join(unpatched_tmp, "unpatched.xml"), ["-k", pr2a.new_tests],
        )
        failed += must_fail(results, "unpatched torch")
        copy_sources(tmp)
        for patch in PATCHES:
            lay_bases(patch, tmp)
            if not apply(patch.file, tmp):
                return [*failed, f"{patch.file} on top of the ones before it"]
        print("\n=== the stack under torch's harness")
        env = test_env(tmp)
        failed += check_imports_patched(tmp, env)
        for patch in PATCHES:
            test_file = os.path.join(tmp, patch.upstream_tests[0])
            if not (patch.on_cpu_whole_file and accelerator_count() >= 2):
                failed += run_harness(patch, test_file, env, tmp, pytest_args)
                continue
            print(f"the whole {patch.upstream_tests[0]} under torch's harness")
            patched = pytest([test_file], env, os.path.join(tmp, "whole.xml"), pytest_args)

            def rerun_unpatched(names: list[str], patch: Patch = patch) -> dict[str, str | None]:
                return pytest(
                    [os.path.join(unpatched_tmp, patch.upstream_tests[0])], test_env(None),
                    os.path.join(unpatched_tmp, "rerun.xml"), ["-k", " or ".join(names)],
                )

            failed += compare_whole_file(patch, patched, rerun_unpatched)
    return failed


def needs(test_file: str) -> dict[str, tuple[str, ...]]:
    """``test_file``'s ``NEEDS`` (read, not imported: importing it sets up torch)."""
    with open(test_file) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["NEEDS"]:
            return ast.literal_eval(node.value)
    raise ValueError(f"no NEEDS in {test_file}")


def check_stand_in_unpatched() -> list[str]:
    """The stand-in tests on the installed torch: those in NEEDS must fail, the others pass."""
    needing = needs(os.path.join(ROOT, STAND_IN_TEST))
    print(f"\n=== {STAND_IN_TEST} on unpatched torch ({installed_torch()}): {', '.join(needing)} fail, the others pass")
    with tempfile.TemporaryDirectory() as tmp:
        results = pytest([os.path.join(ROOT, STAND_IN_TEST)], test_env(None), os.path.join(tmp, "junit.xml"), [])
    fixed = {name: reason for name, reason in results.items() if name in needing}
    failed = must_fail(fixed, "unpatched torch")
    if len(fixed) != len(needing):
        failed.append(f"ran {len(fixed)} of the {len(needing)} tests in NEEDS")
    failed += [f"{name} ({reason})" for name, reason in results.items() if name not in fixed and reason]
    return failed


def check_stack(pytest_args: list[str]) -> list[str]:
    print("\n=== the stack: every patch, in order, on one copy")
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        copy_sources(tmp)
        for patch in PATCHES:
            lay_bases(patch, tmp)
            if not apply(patch.file, tmp):
                return [f"{patch.file} on top of the ones before it"]
        print("applies")
        env = test_env(tmp, applied=tuple(p.stand_in for p in PATCHES if p.stand_in))
        failed += check_imports_patched(tmp, env)
        if failed:
            return failed
        # Note: PR 1's own tests ran in its step; it shares no file with 2a and 2b
        runs = (
            (STAND_IN_TEST, [os.path.join(ROOT, STAND_IN_TEST)]),
            ("project tests", [os.path.join(ROOT, t) for t in STACK_PROJECT_TESTS]),
        )
        for index, (what, tests) in enumerate(runs):
            results = pytest(tests, env, os.path.join(tmp, f"stack{index}.xml"), pytest_args)
            failed += failed_tests(results, what)
    return failed


def skipped_tests(junit_xml: str) -> list[str]:
    if not os.path.exists(junit_xml):
        return []
    return [case.get("name") for case in ET.parse(junit_xml).iter("testcase") if case.find("skipped") is not None]


def check_rehearsal(pytest_args: list[str]) -> list[str]:
    """The torch-style tests the stack adds, as a GPU runner runs them, on CPU, several times in a
    row: on the stack, with ``skip_if_lt_x_gpu`` lifted (``test_on_cpu.py``: threads where the class
    uses threads, gloo processes where it uses processes). A test that skips here (other than the
    NCCL-guarded ones of SKIPPED_ON_CPU) fails the step. It catches what depends on how the ranks
    run (a race between threads that share one process's generators), not what needs a device:
    the tensors stay on CPU, so FSDP moves nothing, checkpoint has no device RNG state to restore,
    and NCCL, streams and device memory are not exercised (the stand-in scenarios and
    ``--gpu`` cover those). PR 2a's new tests need an accelerator's device module: not rehearsed."""
    print("\n=== rehearsal: the stack's new torch-style tests on CPU with the GPU skip lifted")
    on_cpu = os.path.join(HERE, "test_on_cpu.py")
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        copy_sources(tmp)
        for patch in PATCHES:
            lay_bases(patch, tmp)
            if not apply(patch.file, tmp):
                return [f"{patch.file} on top of the ones before it"]
        failed += check_imports_patched(tmp, test_env(tmp))
        if failed:
            return failed
        for index, patch in enumerate(PATCHES):
            if not patch.rehearsal_runs:
                print(f"{patch.name}: not rehearsed (its new tests need an accelerator's device module)")
                continue
            test_file = os.path.join(tmp, patch.upstream_tests[0])
            env = test_env(tmp, test_file=test_file)
            k = ["-k", patch.new_tests] if patch.new_tests else []
            for run in range(1, patch.rehearsal_runs + 1):
                what = f"{patch.name}, run {run} of {patch.rehearsal_runs}"
                print(f"{what}: {patch.upstream_tests[0]} {' '.join(k)}")
                junit_xml = os.path.join(tmp, f"rehearsal{index}_{run}.xml")
                results = pytest([on_cpu], env, junit_xml, [*k, *pytest_args])
                failed += failed_tests(results, what)
                skipped = set(skipped_tests(junit_xml)) - set(SKIPPED_ON_CPU.get(patch.file, ()))
                failed += [f"{what}: {name} skipped" for name in sorted(skipped)]
    return failed


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
    parser.add_argument(
        "--patch", choices=[patch.file for patch in PATCHES] + ["stack", "rehearsal"],
        help="check only this patch (or the stack, or the rehearsal)",
    )
    parser.add_argument("--gpu", action="store_true", help="only the checks that need an accelerator (see check_gpu)")
    args, pytest_args = parser.parse_known_args()  # everything else goes to pytest (e.g. -x)
    import torch

    if torch.__version__.split("+")[0] != BASE_RELEASE:
        print(f"note: the patches are against torch {BASE_RELEASE}; this is torch {torch.__version__}")
    durations: dict[str, float] = {}
    if args.gpu:
        failed = timed("gpu", lambda: check_gpu(pytest_args), durations)
        print(f"\n=== summary\naccelerator checks: {'FAILED' if failed else 'ok'} ({durations['gpu']:.0f} s)")
        for what in failed:
            print(f"  failed: {what}")
        print_failure_output(failed)
        return 1 if failed else 0
    failures = {
        patch.name: timed(patch.name, lambda patch=patch: check_patch(patch, pytest_args), durations)
        for patch in PATCHES
        if args.patch in (None, patch.file)
    }
    gloo = None
    if args.patch is None:
        name = "stand-in tests on unpatched torch (NEEDS fail, the others pass)"
        failures[name] = timed(name, check_stand_in_unpatched, durations)
    if args.patch in (None, "stack"):
        failures["stack"] = timed("stack", lambda: check_stack(pytest_args), durations)
    if args.patch in (None, "rehearsal"):
        failures["rehearsal"] = timed("rehearsal", lambda: check_rehearsal(pytest_args), durations)
    if args.patch is None:
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
    print_failure_output([line for failed in failures.values() for line in failed])
    return 1 if any(failures.values()) else 0


def print_failure_output(failed: list[str]) -> None:
    """The output of each failed test that a line of ``failed`` names, and of each run without a report."""
    for name, output, always in FAILURE_OUTPUT:
        if always or any(re.search(rf"\b{re.escape(name)}\b", line) for line in failed):
            print(f"\n=== output of {name}\n{output}")


if __name__ == "__main__":
    sys.exit(main())
