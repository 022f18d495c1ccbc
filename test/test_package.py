"""The package as a user installs it: a wheel built from this checkout, in a fresh venv that reuses the torch
already installed, passes ``torch-fsdp-ext doctor``."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

from torch.testing._internal.common_utils import TestCase, run_tests

from common import ROOT

# What a wheel is built from: the package and the files setup.py reads.
SOURCES = ("setup.py", "README.md", "LICENSE", "torch_fsdp_ext")


def _can_build_wheels() -> bool:
    try:
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


# Note: a venv made with --system-site-packages sees the *base* interpreter's packages, so only
# there is the torch under test the one the venv reuses (CI runs this on its torch 2.13.0).
@unittest.skipUnless(sys.prefix == sys.base_prefix, "runs on the base interpreter, whose torch a venv can reuse")
@unittest.skipUnless(_can_build_wheels(), "needs setuptools and wheel to build without isolation")
class TestWheel(TestCase):
    def test_wheel_installs_into_a_fresh_venv_with_torch_and_passes_doctor(self):
        with tempfile.TemporaryDirectory() as tmp:
            source = os.path.join(tmp, "source")
            os.makedirs(source)
            for name in SOURCES:  # a copy, so that the build leaves nothing in the checkout
                path = os.path.join(ROOT, name)
                copy = shutil.copytree if os.path.isdir(path) else shutil.copy
                copy(path, os.path.join(source, name))
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_FSDP_EXT_DISABLE")}
            dist_dir = os.path.join(tmp, "dist")
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                 "-w", dist_dir, source],
                check=True, capture_output=True, env=env, timeout=300,
            )
            (wheel,) = glob.glob(os.path.join(dist_dir, "torch_fsdp_ext-*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                names = archive.namelist()
                metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
            self.assertTrue(any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
                                for n in names), names)
            for field in ("License: BSD-3-Clause", "Requires-Python: >=3.9", "Requires-Dist: torch>=2.5",
                          "Provides-Extra: test", "# torch_fsdp_ext"):
                self.assertIn(field, metadata)

            # pip resolves torch>=2.5 from the base interpreter's site-packages: nothing is downloaded.
            venv = os.path.join(tmp, "venv")
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv],
                           check=True, env=env, timeout=120)
            python = os.path.join(venv, "bin", "python")
            subprocess.run([python, "-m", "pip", "install", "--no-index", "-q", wheel],
                           check=True, capture_output=True, env=env, timeout=300)
            where = subprocess.run(
                [python, "-c", "import torch_fsdp_ext, torch; print(torch_fsdp_ext.__file__, torch.__file__)"],
                check=True, capture_output=True, text=True, env=env, cwd=tmp, timeout=120,
            ).stdout.split()
            self.assertTrue(where[0].startswith(venv), where)  # the wheel's copy, not this checkout
            self.assertFalse(where[1].startswith(venv), where)  # the torch that was already installed

            doctor = subprocess.run(
                [os.path.join(venv, "bin", "torch-fsdp-ext"), "doctor", "--world-size", "1"],
                capture_output=True, text=True, env=env, cwd=tmp, timeout=300,
            )
            self.assertEqual(doctor.returncode, 0, doctor.stdout + doctor.stderr)
            self.assertIn("self-test: 1 rank(s)", doctor.stdout)


if __name__ == "__main__":
    run_tests()
