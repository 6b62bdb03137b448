"""The one error boundary: known failures map to a message, a hint and an exit code."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """distcheck's exit codes (also listed in the README and ``--help``)."""

    OK = 0                 # every scenario behaved as expected / the script ran clean
    FINDINGS = 1           # a scenario did not behave as expected, or the script has findings
    USAGE = 2              # bad command line, unknown scenario, unreadable input
    LAUNCH_FAILED = 3      # distcheck could not run the job (rendezvous, ports, run dir, ...)
    TIMEOUT = 4            # the global --timeout ended the run
    CORRUPT_INPUT = 5      # a saved run (or dump) exists but cannot be read: bad JSON, unknown schema
    NOTHING_RAN = 6        # every target was skipped: nothing was checked, so nothing passed
    INTERRUPTED = 130      # Ctrl-C / SIGTERM


class DistcheckError(Exception):
    """An error with a message for people, a hint for what to do, and an exit code."""

    exit_code = ExitCode.LAUNCH_FAILED

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(DistcheckError):
    exit_code = ExitCode.USAGE


class LaunchError(DistcheckError):
    exit_code = ExitCode.LAUNCH_FAILED


class CorruptInputError(DistcheckError):
    """Input that exists but cannot be read (a torn report.json, a foreign schema)."""

    exit_code = ExitCode.CORRUPT_INPUT
