"""What the GPU lane imports, against what the GPU machine has (#66): every module the lane's programs reach in this
repository, read for its imports (those inside functions too: a phase runs them there), and each package outside
the standard library either on the machine already (tests/gpu/machine_packages.txt) or among the wheels the lane
carries (tests/gpu/requirements.txt). The lane broke on the GPU when tests/edge_harness.py imported the rehearsal,
which needs the Pulumi SDK: found here now, not there."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The lane's programs: what tests/gpu/device.sh runs there.
ENTRIES = ("tests.gpu.lane", "tests.gpu.lane_router", "tests.gpu.lane_cotenants", "tests.gpu.nccl", "tests.gpu.flags",
           "tests.gpu.model")  # fmt: skip
OURS = ("tests", "components", "benchmarks", "scripts")
# Import names whose distribution is named otherwise.
DISTRIBUTIONS = {"yaml": "pyyaml", "google": "protobuf", "grpc": "grpcio", "PIL": "pillow", "zmq": "pyzmq",
                 "vllm_router": "vllm-router"}  # fmt: skip


def module_file(name: str) -> Path | None:
    for path in (ROOT / (name.replace(".", "/") + ".py"), ROOT / name.replace(".", "/") / "__init__.py"):
        if path.exists():
            return path
    return None


def reached() -> tuple[dict[str, Path], dict[str, set[str]]]:
    """(every module of ours the entries reach, every other package imported: top-level name -> by which)."""
    ours: dict[str, Path] = {}
    others: dict[str, set[str]] = {}
    waiting = list(ENTRIES)
    while waiting:
        name = waiting.pop()
        if name in ours or module_file(name) is None:
            continue
        ours[name] = module_file(name)
        for node in ast.walk(ast.parse(ours[name].read_text())):
            found = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for imported in found:
                top = imported.split(".")[0]
                if top in OURS:
                    waiting.append(imported)
                elif top not in sys.stdlib_module_names:
                    others.setdefault(top, set()).add(name)
    return ours, others


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def available() -> set[str]:
    machine = (ROOT / "tests/gpu/machine_packages.txt").read_text().splitlines()
    carried = [line.split("==")[0] for line in (ROOT / "tests/gpu/requirements.txt").read_text().splitlines()]
    return {normal(line) for line in [*machine, *carried] if line.strip() and not line.startswith("#")}


def test_every_package_the_lane_imports_is_on_the_gpu_machine_or_carried_there():
    ours, others = reached()
    assert len(ours) > 20  # the lane reaches the program's planning code, not only its own files
    have = available()
    missing = {top: sorted(by) for top, by in others.items() if normal(DISTRIBUTIONS.get(top, top)) not in have}
    assert missing == {}, f"imported by the lane, not on the GPU machine nor among its wheels: {missing}"


@pytest.mark.parametrize("module", ["tests.e2e.rehearsal", "tests.e2e.cli_stack", "pulumi"])
def test_the_lane_never_reaches_the_rehearsal_or_the_pulumi_sdk(module):
    ours, others = reached()
    assert module not in ours and module.split(".")[0] not in others


def test_the_check_finds_what_a_module_imports_inside_a_function(tmp_path, monkeypatch):
    """It can fail: a module of ours that imports the Pulumi SDK inside a function is reached and named."""
    package = tmp_path / "tests" / "gpu"
    package.mkdir(parents=True)
    (package / "lane.py").write_text("def phase():\n    import pulumi\n    from tests.gpu import helper\n")
    (package / "helper.py").write_text("import yaml\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ENTRIES", ("tests.gpu.lane",))
    ours, others = reached()
    assert set(ours) == {"tests.gpu.lane", "tests.gpu.helper"}
    assert others == {"pulumi": {"tests.gpu.lane"}, "yaml": {"tests.gpu.helper"}}
