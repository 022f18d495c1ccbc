"""``--help``, ``setup.py``'s description, the package docstring, README.md and ``doctor`` name the same three
failures, from ``torch_fsdp_ext/_failures.py``; ``doctor``'s legend says what each of its rows means."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
from torch_fsdp_ext import __main__ as cli, _doctor
from torch_fsdp_ext._failures import FAILURES, HEADLINE
from torch_fsdp_ext._install import FixStatus, Status

from common import ROOT


def plain(text: str) -> str:
    """Markdown and reST code marks and line breaks removed: the words as read."""
    return " ".join(text.replace("``", "").replace("`", "").split())


class TestOneStory(TestCase):
    def assert_names_the_failures(self, text: str, where: str) -> None:
        self.assertIn(HEADLINE, plain(text), where)
        for failure in FAILURES.values():
            self.assertIn(failure, plain(text), where)
        for other in ("two FSDP2", "repairs FSDP2"):
            self.assertNotIn(other, plain(text), where)

    def test_one_failure_per_fix(self):
        self.assertEqual(tuple(FAILURES), torch_fsdp_ext.FIX_NAMES)
        self.assertTrue(HEADLINE.startswith("three "))
        self.assertEqual(len(FAILURES), 3)

    def test_help_setup_docstring_and_readme_name_the_same_failures(self):
        help_text = io.StringIO()
        with contextlib.redirect_stdout(help_text), self.assertRaises(SystemExit):
            cli.main(["--help"])
        self.assert_names_the_failures(help_text.getvalue(), "--help")
        self.assertIn(f"torch_fsdp_ext repairs {HEADLINE}: {'; '.join(FAILURES.values())}.",
                      plain(torch_fsdp_ext.__doc__))
        # setup.py reads _failures.py without importing the package: its own interpreter, as pip runs it.
        description = subprocess.run(
            [sys.executable, "setup.py", "--description"], capture_output=True, text=True, cwd=ROOT, timeout=120,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        self.assertEqual(description.returncode, 0, description.stderr)
        self.assertEqual(description.stdout.strip().splitlines()[-1],
                         f"Repairs {HEADLINE}: {'; '.join(FAILURES.values())}.")
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        self.assert_names_the_failures(readme, "README.md")
        for name, failure in FAILURES.items():  # each fix by name beside its failure, where it says how to take one
            self.assertIn(f"{name}: {failure}", plain(readme))

    def test_doctor_legend_names_the_failures_and_each_partly_row(self):
        report = torch_fsdp_ext.status()
        lines = _doctor.legend(report, {})
        self.assertIn("fixes: " + "; ".join(f"{n} = {f}" for n, f in FAILURES.items()), lines)
        # No line explains "partly" for a fix whose row does not say it.
        rows, _ = _doctor.fix_rows(report, {})
        partly = [row[0] for row in rows[1:] if row[1] == "partly"]
        self.assertEqual([line.split()[0] for line in lines if " partly: " in line], partly)


def fix_status(name: str, who: dict, key: str) -> FixStatus:
    return FixStatus(name, "", True, "", True, details={key: who})


class TestDoctorLegendOnEachRelease(TestCase):
    """The rows of 2.13.0 (recompute partly: torch replays the part the seed scenario needs) and of 2.14.1
    (reduce partly: torch fixes a part the seed scenario does not exercise) under one legend rule."""

    RECOMPUTE_213 = {"input cast": "upstream", "output cast": "upstream", "root input move": "torch_fsdp_ext",
                     "autocast state": "torch_fsdp_ext"}
    REDUCE_214 = {"mixed gradient dtypes": "torch_fsdp_ext", "frozen first forward": "upstream",
                  "TP all-reduce": "torch_fsdp_ext"}
    REDUCE_213 = {"mixed gradient dtypes": "torch_fsdp_ext", "frozen first forward": "torch_fsdp_ext",
                  "TP all-reduce": "torch_fsdp_ext"}

    def legend(self, recompute: dict, reduce: dict, outcomes: dict) -> list[str]:
        fixes = {
            "dtype": FixStatus("dtype", "", True, "", True, details={"strategy": "upcast"}),
            "recompute": fix_status("recompute", recompute, "replays"),
            "reduce": fix_status("reduce", reduce, "parts"),
        }
        return _doctor.legend(Status("x", True, [], fixes), outcomes)[3:]

    def test_release_2_13(self):
        outcomes = {"recompute": {"without": "ok", "with": "ok"}, "reduce": {"without": "AssertionError", "with": "ok"}}
        self.assertEqual(self.legend(self.RECOMPUTE_213, self.REDUCE_213, outcomes), [
            "recompute partly: torch repairs input cast, output cast; the plugin root input move, autocast state; "
            "so the seed scenario runs without the plugin too",
        ])

    def test_release_2_14_1(self):
        outcomes = {"recompute": {"without": "ok", "with": "ok"}, "reduce": {"without": "AssertionError", "with": "ok"}}
        self.assertEqual(self.legend(self.RECOMPUTE_213, self.REDUCE_214, outcomes), [
            "recompute partly: torch repairs input cast, output cast; the plugin root input move, autocast state; "
            "so the seed scenario runs without the plugin too",
            "reduce partly: torch repairs frozen first forward; the plugin mixed gradient dtypes, TP all-reduce; "
            "the seed scenario needs the plugin's part",
        ])


if __name__ == "__main__":
    run_tests()
