"""Prove that each upstream PR alone fixes its failure, without touching the installed torch.

    python tools/upstream/check.py            # on torch 2.15.0, the release the patches are against
    python tools/upstream/check.py -k parity  # extra pytest arguments go to every run

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

Finally it checks that the patches also apply one after the other (the stack).
Exits non-zero if any step of any patch fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PACKAGE = "torch/distributed/fsdp/_fully_shard"
BASE_RELEASE = "2.15.0"


class Patch(NamedTuple):
    file: str  # in tools/upstream/
    upstream_test: str  # the test file the patch adds, relative to torch's repository root
    project_tests: tuple[str, ...]  # relative to this repository's root


# The stack, in order. Project tests: PR 1 has the semantics of dtype_strategy="preserve"
# (test_preserve.py; test_dtype.py tests the plugin's upcast, which the native patch does
# not do); PR 2 replays the root's input move (test_recompute.py, and the CPU version of
# its own test's scenarios).
PATCHES = (
    Patch(
        "pr1-mixed-orig-dtypes.patch",
        "test/distributed/_composable/fsdp/test_fully_shard_mixed_dtype.py",
        ("test/test_preserve.py",),
    ),
    Patch(
        "pr2-recompute-root-input-move.patch",
        "test/distributed/_composable/fsdp/test_fully_shard_recompute_inputs.py",
        ("test/test_recompute.py", "tools/upstream/test_recompute_inputs_on_cpu.py"),
    ),
)

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
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(REDIRECT)
        upstream_test = os.path.join(tmp, patch.upstream_test)
        env = dict(
            os.environ,
            TORCH_FSDP_EXT_DISABLE="1",
            TORCH_FSDP_EXT_TESTS_UPSTREAM_ONLY="1",
            UPSTREAM_TEST_FILE=upstream_test,
        )
        # A torch-style test runs all its subtests in one test: minutes on a small CPU machine.
        env.setdefault("TORCH_FSDP_EXT_TEST_TIMEOUT", "600")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, ROOT, os.environ.get("PYTHONPATH")) if p)
        where = subprocess.run(
            [sys.executable, "-c", "import torch.distributed.fsdp._fully_shard._fsdp_state as m; print(m.__file__)"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
        if not where.startswith(tmp):
            return [f"FSDP2 was imported from {where}, not from the patched copy"]
        print(f"applies; FSDP2 imported from the patched copy: {where}")
        tests = [os.path.join(HERE, "test_on_cpu.py"), *(os.path.join(ROOT, t) for t in patch.project_tests)]
        if accelerator_count() > 0:
            tests.insert(0, upstream_test)  # as torch's CI runs it
        else:
            print(f"{patch.upstream_test} as torch's harness runs it: not run, {NO_ACCELERATOR}")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *tests, *pytest_args], cwd=ROOT, env=env)
        return [f"tests (pytest exit status {run.returncode})"] if run.returncode != 0 else []


def check_stack() -> list[str]:
    print("\n=== the stack: every patch, in order, on one copy")
    with tempfile.TemporaryDirectory() as tmp:
        copy_package(tmp)
        for patch in PATCHES:
            if not apply(patch.file, tmp):
                return [f"{patch.file} on top of the ones before it"]
    print("applies")
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pytest_args = parser.parse_known_args()[1]  # everything else goes to pytest (e.g. -k parity)
    import torch

    if torch.__version__.split("+")[0] != BASE_RELEASE:
        print(f"note: the patches are against torch {BASE_RELEASE}; this is torch {torch.__version__}")
    failures = {patch.file: check_patch(patch, pytest_args) for patch in PATCHES}
    failures["stack"] = check_stack()
    print("\n=== summary")
    for name, failed in failures.items():
        print(f"{name}: {'FAILED: ' + '; '.join(failed) if failed else 'ok'}")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
