"""Prove that the upstream patch alone fixes both failures, without touching the installed torch.

    python tools/upstream/check.py

1. copies the installed torch's FSDP2 package (``torch/distributed/fsdp/_fully_shard``)
   into a temporary directory,
2. checks that the patch applies (``git apply --check``) and applies it there,
3. runs this project's behaviour tests (test_dtype.py, test_recompute.py) with the
   plugin disabled, importing FSDP2 from the patched copy (a ``sitecustomize`` there
   redirects ``torch.distributed.fsdp._fully_shard`` in every test process).

Tests of the plugin's own machinery are skipped in that run (``plugin_specific``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PATCH = os.path.join(HERE, "fsdp2-mixed-dtype-and-recompute-v2.13.0.patch")
PACKAGE = "torch/distributed/fsdp/_fully_shard"

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


def installed_package() -> str:
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp", "_fully_shard")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k seed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(installed_package(), os.path.join(tmp, PACKAGE), ignore=shutil.ignore_patterns("__pycache__"))
        check = subprocess.run(["git", "apply", "--check", "--verbose", PATCH], cwd=tmp, capture_output=True, text=True)
        if check.returncode != 0:
            print(f"The patch no longer applies to this torch's FSDP2 sources ({installed_package()}):\n{check.stderr}")
            print("Rebase it on this release's torch/distributed/fsdp/_fully_shard and regenerate it with git diff.")
            return 1
        subprocess.run(["git", "apply", PATCH], cwd=tmp, check=True)
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(REDIRECT)
        env = dict(os.environ, TORCH_FSDP_EXT_DISABLE="1", TORCH_FSDP_EXT_TESTS_UPSTREAM_ONLY="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, ROOT, os.environ.get("PYTHONPATH")) if p)
        where = subprocess.run(
            [sys.executable, "-c", "import torch.distributed.fsdp._fully_shard._fsdp_state as m; print(m.__file__)"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
        if not where.startswith(tmp):
            print(f"FSDP2 was imported from {where}, not from the patched copy in {tmp}")
            return 1
        print(f"patch applies; FSDP2 imported from the patched copy: {where}")
        tests = [os.path.join("test", "test_dtype.py"), os.path.join("test", "test_recompute.py")]
        return subprocess.run([sys.executable, "-m", "pytest", "-q", *tests, *args.pytest_args], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
