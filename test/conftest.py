"""The suite's two pytest additions.

- Progress of ``python -m pytest test -q``, one line per test file: its path as it starts, pytest's dots as its
  tests run, its duration as it ends. On a loaded machine a file can take minutes; the line shows which one runs.
  A run stopped early (Ctrl-C, ``-x``) ends with each started file's passed / failed / skipped counts so far.
- The quick tier, ``python -m pytest test -q -m quick``: the tests named in ``QUICK`` get the ``quick`` marker.
  test/test_quick_tier.py fails when an entry names no test.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One test per fix and per headline path: each reproduces a failure without the plugin where this torch has it,
# or checks the plugin's result against a reference. Node ids as pytest prints them, relative to the checkout.
QUICK = (
    "test/test_demo.py::TestDemo::test_readme_demo_command",
    "test/test_dtype.py::TestSeedScenario::test_assertion_reproduces_without_plugin_and_is_fixed_with_it",
    "test/test_dtype.py::TestSeedScenario::test_training_matches_single_process_reference",
    "test/test_preserve.py::TestPreserve::test_assertion_without_plugin_then_preserve_keeps_loaded_dtypes",
    "test/test_recompute.py::TestSeedFlavour::test_checkpoint_error_reproduces_without_plugin",
    "test/test_recompute.py::TestSeedFlavour::test_1_checkpoint_fsdp_module_under_autocast",
    "test/test_reduce.py::TestReduceCases::test_fresh_gradient_on_the_sync_micro_batch_equals_reference",
    "test/test_reduce_tp.py::TPReduceTest::test_witness_with_fix",
    "test/test_compute_dtype.py::TestComputeDtype::test_transformers_keep_in_fp32_lists_through_auto",
    "test/test_loaded_dtypes.py::TestAsLoaded::test_save_pretrained_writes_the_loaded_dtypes_and_sizes",
    "test/test_headline.py::TestHeadlineCase::test_moe_with_fp32_router_under_trainer_fsdp2",
    "test/test_rank_check.py::TestFixesInstalled::test_a_rank_without_a_fix_fails_on_every_rank_naming_the_fix_and_the_rank",
    "test/test_run.py::RunTest::test_launcher_fixes_a_script_that_never_imports_the_plugin",
    "test/test_api.py::TestInstallUninstall::test_import_installed_what_this_torch_needs",
    "test/test_doctor.py::TestDoctor::test_table_and_exit_status",
    "test/test_own_warnings.py::TestOwnWarnings::test_state_dict_as_loaded",
    "test/test_quick_tier.py::TestQuickTier::test_every_entry_names_a_test",
)


def checkout_node_id(item) -> str:
    """``item``'s node id relative to the checkout, whatever directory pytest was started from."""
    path = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
    return path + item.nodeid[len(item.nodeid.split("::")[0]):]


class FileProgress:
    def __init__(self, config) -> None:
        self.config = config
        self.started: float | None = None
        self.outcomes: dict[str, dict[str, str]] = {}  # file -> node id -> its outcome so far
        self.session = None

    def pytest_sessionstart(self, session) -> None:
        self.session = session

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        # Note: looked up here, not at configure time, when the terminal reporter may not be registered yet.
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.started is None:
            reporter.ensure_newline()
            reporter.write(f"{item.nodeid.split('::')[0]} ", flush=True)
            self.started = time.monotonic()
        outcome = yield
        # A KeyboardInterrupt (Ctrl-C) leaves the protocol as an exception; -x sets shouldfail.
        stopping = outcome.excinfo is not None or bool(item.session.shouldfail or item.session.shouldstop)
        if reporter is not None and (nextitem is None or nextitem.path != item.path or stopping):
            stopped = " stopped after" if stopping and nextitem is not None else ""
            reporter.write(f"{stopped} {time.monotonic() - self.started:.0f} s\n", flush=True)
            self.started = None

    def pytest_runtest_logreport(self, report) -> None:
        # A test counts once: failed if any phase failed, else skipped if one skipped, else passed.
        outcomes = self.outcomes.setdefault(report.nodeid.split("::")[0], {})
        before = outcomes.get(report.nodeid)
        if report.failed or before == "failed":
            outcomes[report.nodeid] = "failed"
        elif report.skipped or before == "skipped":
            outcomes[report.nodeid] = "skipped"
        elif report.when == "call":
            outcomes[report.nodeid] = "passed"

    def pytest_terminal_summary(self, terminalreporter, exitstatus) -> None:
        interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
        stopped = self.session is not None and (self.session.shouldstop or self.session.shouldfail)
        if not (interrupted or stopped) or not self.outcomes:
            return
        why = "interrupted" if interrupted else "stopped after a failure"
        terminalreporter.write_sep("-", f"{why}: per-file totals so far")
        for path, outcomes in self.outcomes.items():
            counts = Counter(outcomes.values())
            terminalreporter.write_line(
                f"{path}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
            )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "quick: the quick tier (python -m pytest test -q -m quick), see QUICK")
    config.pluginmanager.register(FileProgress(config), "torch_fsdp_ext_file_progress")


def pytest_collection_modifyitems(config, items) -> None:
    quick = set(QUICK)
    for item in items:
        if checkout_node_id(item) in quick:
            item.add_marker(pytest.mark.quick)
