"""ray_join.py run for real against a fake `ray` (module and CLI) that reports a chosen cluster state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.plan.programs import script_program

FAKE_RAY_MODULE = """
import json, os
def init(address=None, **kwargs):
    if os.environ.get("FAKE_RAY_UNREACHABLE"):
        raise ConnectionError(f"could not connect to {address}")
def nodes():
    return json.loads(os.environ["FAKE_RAY_NODES"])
"""
FAKE_RAY_CLI = """#!/bin/sh
echo 'Active:'
echo ' 1 node_head'
echo 'Resources: 1.0/2.0 GPU'
"""


@pytest.fixture
def fake_ray(tmp_path):
    package = tmp_path / "site" / "ray"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_RAY_MODULE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(FAKE_RAY_CLI)
    (bin_dir / "ray").chmod(0o755)
    return tmp_path


def node(address: str, gpus: float = 1.0, alive: bool = True) -> dict:
    return {"NodeManagerAddress": address, "Alive": alive, "Resources": {"GPU": gpus}}


def run_join(fake_ray: Path, nodes: list[dict], gpus_needed: int, unreachable: bool = False, timeout: float = 2):
    params = {
        "node": "spark-01",
        "ray_address": "10.9.0.1:6379",
        "expected": [
            {"name": "spark-01", "fabric_address": "10.9.0.1"},
            {"name": "spark-02", "fabric_address": "10.9.0.2"},
        ],
        "gpus_needed": gpus_needed,
        "timeout_seconds": timeout,
        "poll_seconds": 0.2,
        "progress_seconds": 30,
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(fake_ray / "site"),
        "PATH": f"{fake_ray / 'bin'}:{os.environ['PATH']}",
        "FAKE_RAY_NODES": json.dumps(nodes),
    }
    if unreachable:
        env["FAKE_RAY_UNREACHABLE"] = "1"
    return subprocess.run(
        [sys.executable, "-"],
        input=script_program("ray_join.py", params),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_ready_when_every_node_is_alive_with_the_gpus(fake_ray):
    result = run_join(fake_ray, [node("10.9.0.1"), node("10.9.0.2")], gpus_needed=2)
    assert result.returncode == 0, result.stdout
    assert "[spark-01] Ray ready after" in result.stdout and "2 node(s) alive, 2 GPU" in result.stdout


def test_a_missing_node_is_named_with_its_fabric_address_and_ray_status(fake_ray):
    result = run_join(fake_ray, [node("10.9.0.1"), node("10.9.0.2", alive=False)], gpus_needed=2)
    assert result.returncode == 1
    assert "missing node spark-02 (fabric address 10.9.0.2)" in result.stdout
    assert "GPUs in Ray: 1, needed for tensor x pipeline parallel: 2" in result.stdout
    assert "--- ray status ---" in result.stdout and "Resources: 1.0/2.0 GPU" in result.stdout


def test_a_node_on_the_management_address_does_not_count(fake_ray):
    """Ray registered spark-02 under another address (e.g. its management NIC): still missing."""
    result = run_join(fake_ray, [node("10.9.0.1"), node("192.0.2.7")], gpus_needed=2)
    assert result.returncode == 1 and "missing node spark-02 (fabric address 10.9.0.2)" in result.stdout


def test_an_unreachable_gcs_is_reported(fake_ray):
    result = run_join(fake_ray, [], gpus_needed=2, unreachable=True, timeout=1)
    assert result.returncode == 1
    assert "could not connect to Ray at 10.9.0.1:6379 within 1 s" in result.stdout
