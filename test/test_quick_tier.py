"""The quick tier (``python -m pytest test -q -m quick``) and the per-file totals of a run stopped early."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

from torch.testing._internal.common_utils import TestCase, run_tests

from common import ROOT
from conftest import QUICK


def pytest_in(cwd: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))))


class TestQuickTier(TestCase):
    def test_every_entry_names_a_test(self):
        files = sorted({node_id.split("::")[0] for node_id in QUICK})
        missing = [path for path in files if not os.path.exists(os.path.join(ROOT, path))]
        self.assertEqual(missing, [], "test/conftest.py QUICK names files that do not exist")
        result = pytest_in(ROOT, "--collect-only", "-m", "quick", *files)
        collected = {line for line in result.stdout.splitlines() if "::" in line}
        self.assertEqual(sorted(set(QUICK) - collected), [], "test/conftest.py QUICK names tests that do not exist")
        self.assertEqual(len(collected), len(QUICK), result.stdout)


STOPPED_RUN = {
    "test_a.py": """
        import unittest


        def test_one():
            pass


        def test_two():
            pass


        @unittest.skip("a reason")
        def test_skipped():
            pass
    """,
    "test_b.py": """
        import os
        import signal


        def test_one():
            pass


        def test_fails():
            assert False


        def test_interrupted():
            # Python's own Ctrl-C handler: a parent that ignores SIGINT (a test runner's rank) passes that on.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C


        def test_never_run():
            pass
    """,
}


class TestStoppedRunTotals(TestCase):
    def run_stopped(self, *args: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(ROOT, "test", "conftest.py"), tmp)
            for name, code in STOPPED_RUN.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(textwrap.dedent(code))
            return pytest_in(tmp, *args).stdout

    def test_interrupted_run_prints_each_files_totals(self):
        out = self.run_stopped("-k", "not fails")
        self.assertIn("test_b.py . stopped after", out)
        self.assertIn("interrupted: per-file totals so far", out)
        self.assertIn("test_a.py: 2 passed, 0 failed, 1 skipped\ntest_b.py: 1 passed, 0 failed, 0 skipped\n", out)

    def test_run_stopped_by_x_prints_each_files_totals(self):
        out = self.run_stopped("-x")
        self.assertIn("test_b.py .F stopped after", out)
        self.assertIn("stopped after a failure: per-file totals so far", out)
        self.assertIn("test_a.py: 2 passed, 0 failed, 1 skipped\ntest_b.py: 1 passed, 1 failed, 0 skipped\n", out)

    def test_complete_run_prints_no_totals(self):
        out = self.run_stopped("test_a.py")
        self.assertIn("test_a.py ..s", out)
        self.assertNotIn("per-file totals", out)


if __name__ == "__main__":
    run_tests()
