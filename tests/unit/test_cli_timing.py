"""benchmarks/cli_timing.py's no-change ups, with and without the engine's preview, on a fake stack (the benchmark
itself needs simulated nodes and the toolchain; what it measures and prints is held here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import cli_timing
from tests.e2e.cli_stack import ResourceEvent, Run


class FakeStack:
    """Each `up` burns a little CPU in a child process, twice as much with the engine's preview first."""

    def __init__(self, changes=None):
        self.calls, self.changes = [], changes or {}

    def up(self, preview_first=False):
        self.calls.append(preview_first)
        for _ in range(2 if preview_first else 1):
            subprocess.run([sys.executable, "-c", "sum(range(2_000_000))"], check=True)
        resources = {
            name: ResourceEvent(name=name, type="command:local:Command", op=op, started=0.0, finished=1.0)
            for name, op in self.changes.items()
        }
        return Run("up", resources, "", {}, 2.0 if preview_first else 1.0, [])


def test_a_no_change_up_is_timed_with_the_cpu_of_what_it_started():
    stack = FakeStack()
    typed, skipped = cli_timing.timed_up(stack, True), cli_timing.timed_up(stack, False)
    assert stack.calls == [True, False]
    assert typed[0] == 2.0 and skipped[0] == 1.0
    assert typed[1] > skipped[1] > 0  # the children's CPU: two of them, then one


def test_an_up_that_changes_something_is_not_a_figure_of_a_no_change_up():
    with pytest.raises(AssertionError, match="changed"):
        cli_timing.timed_up(FakeStack({"spark-vllm-serve": "update"}), False)


def test_the_report_prints_both_kinds_of_up(capsys):
    run = Run("up", {}, "", {}, 30.0, [], engine_seconds=20.0)
    preview = Run("preview", {}, "", {}, 5.0, [], engine_seconds=3.0)
    destroyed = Run("destroy", {}, "", {}, 9.0, [])
    cli_timing.report(
        {
            "nodes": 2,
            "resources": 40,
            "bring_up": 12.0,
            "up": run,
            "previews": [preview],
            "destroy": destroyed,
            "ups": [((8.0, 6.0), (4.0, 3.0)), ((10.0, 7.0), (5.0, 3.5))],
            "slowest": [],
            "slowest_deletes": [],
        }
    )
    said = capsys.readouterr().out
    assert "pulumi up --yes, no change     wall median   9.0 s   CPU median   6.5 s (2 runs)" in said
    assert "… --skip-preview             wall median   4.5 s   CPU median   3.2 s (2 runs)" in said


def test_the_report_of_a_run_without_previews_leaves_their_line_out(capsys):
    """`--previews 0` (the ups alone): nothing to take a median of, so no preview line, the rest as always."""
    run = Run("up", {}, "", {}, 30.0, [], engine_seconds=20.0)
    cli_timing.report(
        {
            "nodes": 2,
            "resources": 40,
            "bring_up": 12.0,
            "up": run,
            "previews": [],
            "destroy": Run("destroy", {}, "", {}, 9.0, []),
            "ups": [],
            "slowest": [],
            "slowest_deletes": [],
        }
    )
    said = capsys.readouterr().out
    assert "pulumi preview" not in said and "pulumi destroy                 wall    9.0 s" in said
