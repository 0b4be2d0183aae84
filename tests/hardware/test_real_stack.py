"""Opt-in: `pulumi preview`, `up`, a second `preview` and `destroy` on your own stack and hardware.

Runs only when a Pulumi CLI with its Python language host is on PATH (as Pulumi ships it, or
`.toolchain/bin` as scripts/toolchain.sh builds it) and
SPARK_VLLM_HARDWARE_STACK names a stack of this project that is configured for real nodes (e.g.
`dev`), through Pulumi's Automation API with the program in this directory, as `pulumi up` runs it:

    SPARK_VLLM_HARDWARE_STACK=dev venv/bin/python -m pytest tests/hardware -s

`destroy` runs only with SPARK_VLLM_HARDWARE_DESTROY=1, so a shared stack is not torn down by
accident. The test itself talks to no host: Pulumi does, and the program's own readiness wait and
smoke test prove the endpoint serves. The figures the stack measured there (the fabric gate's links and
bandwidth, the memory plan, the smoke test) are kept in tests/hardware/results/<date>-<stack>.json.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.harness import ROOT

STACK = os.environ.get("SPARK_VLLM_HARDWARE_STACK")
RESULTS = Path(__file__).resolve().parent / "results"

pytestmark = [
    pytest.mark.hardware,
    pytest.mark.skipif(
        shutil.which("pulumi") is None or shutil.which("pulumi-language-python") is None,
        reason="the Pulumi CLI with its Python language host is not installed (https://www.pulumi.com/docs/install/)",
    ),
    pytest.mark.skipif(not STACK, reason="set SPARK_VLLM_HARDWARE_STACK to a configured stack to run on real nodes"),
]


@pytest.fixture(scope="module")
def stack():
    from pulumi import automation as auto

    return auto.select_stack(stack_name=STACK, work_dir=str(ROOT))


def record_figures(outputs: dict) -> Path:
    """What the stack measured on this hardware (the fabric gate's links and bandwidth, the memory plan,
    the smoke test), kept in tests/hardware/results/<date>-<stack>.json and printed."""
    from components.plan.fabric import describe

    fabric = outputs.get("fabric") or {}
    print(f"fabric gate: {describe(fabric)}")
    path = RESULTS / f"{time.strftime('%Y-%m-%d')}-{STACK}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = {key: outputs.get(key) for key in ("fabric", "memoryPlan", "smoke", "executor", "headNode")}
    path.write_text(json.dumps(keep, indent=1, sort_keys=True) + "\n")
    return path


def test_up_serves_and_a_second_preview_changes_nothing(stack):
    stack.preview(diff=True, on_output=print)
    result = stack.up(on_output=print)
    outputs = {key: value.value for key, value in result.outputs.items()}
    assert outputs["endpoint"].endswith("/v1")
    smoke_off = getattr(stack.get_all_config().get("spark-vllm:smokeTest"), "value", "true") == "false"
    assert outputs["release"]["validated"] is True or smoke_off
    record_figures(outputs)
    again = stack.preview(on_output=print)
    changed = {op: n for op, n in again.change_summary.items() if op != "same" and n}
    assert changed == {}, f"a second preview wants to change: {changed}"


@pytest.mark.skipif(os.environ.get("SPARK_VLLM_HARDWARE_DESTROY") != "1", reason="set SPARK_VLLM_HARDWARE_DESTROY=1")
def test_destroy_twice_is_safe(stack):
    stack.destroy(on_output=print)
    stack.destroy(on_output=print)
