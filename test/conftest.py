"""Progress of ``python -m pytest test -q``, one line per test file: its path as it starts, pytest's dots as its
tests run, its duration as it ends. On a loaded machine a file can take minutes; the line shows which one runs."""

from __future__ import annotations

import time

import pytest


class FileProgress:
    def __init__(self, config) -> None:
        self.config = config
        self.started: float | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        # Note: looked up here, not at configure time, when the terminal reporter may not be registered yet.
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.started is None:
            reporter.ensure_newline()
            reporter.write(f"{item.nodeid.split('::')[0]} ", flush=True)
            self.started = time.monotonic()
        yield
        if reporter is not None and (nextitem is None or nextitem.path != item.path):
            reporter.write(f" {time.monotonic() - self.started:.0f} s\n", flush=True)
            self.started = None


def pytest_configure(config) -> None:
    config.pluginmanager.register(FileProgress(config), "torch_fsdp_ext_file_progress")
