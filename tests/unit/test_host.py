"""The host check's parts (#68): host_facts.py run for real on this machine with stand-in tools on PATH, the image
probe's torch facts from a site-packages laid out as pip leaves it, and components/plan/host.py's rules over tables
of the spellings drivers, nvidia-smi and torch use."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from components.config import load_cluster_config
from components.plan.host import DRIVER_FOR_CUDA, KNOWN_BAD, arch_runs, host_verdict
from components.plan.programs import script
from components.scripts.node_contract import HostFacts, ImageFacts
from tests.unit.test_preflight import config

GB10 = {"name": "NVIDIA GB10", "compute_cap": "12.1"}
SPARK = {"kernel": "6.17.0-1032-nvidia", "driver": "580.95.05", "cuda": "13.0", "gpus": [GB10]}
CU130 = {
    "torch": "2.11.0",
    "torch_cuda": "13.0",
    "torch_arch": ["sm_100", "sm_120", "sm_75", "sm_80", "sm_86", "sm_90"],
}


def tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def facts(path: str, fabric: str = "enp1s0f1np1") -> dict:
    result = subprocess.run([sys.executable, "-"], input=script("host_facts.py"), capture_output=True, text=True,
                            env={"PATH": path, "FABRIC_IF": fabric}, check=True, timeout=60)  # fmt: skip
    return HostFacts.from_json(json.loads(result.stdout)).to_json()


def test_host_facts_reads_each_tool_as_a_spark_prints_it(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    tool(
        tools,
        "nvidia-smi",
        """case "$1" in
--query-gpu=*) echo 'NVIDIA GB10, 12.1, 580.95.05' ;;
*) echo '| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |' ;;
esac\n""",
    )
    tool(
        tools,
        "docker",
        """echo '{"io.containerd.runc.v2":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}'\n""",
    )
    tool(tools, "nvidia-ctk", "echo 'NVIDIA Container Toolkit CLI version 1.18.0'; echo 'commit: abc'\n")
    tool(tools, "dpkg-query", 'test "$4" = rdma-core && printf 50.0-2ubuntu0.2\n')
    tool(
        tools,
        "ethtool",
        'test "$2" = enp1s0f1np1 || exit 1\nprintf "driver: mlx5_core\\nfirmware-version: 28.45.4028 (NVD0000000087)\\n"\n',
    )
    found = facts(str(tools))
    assert found["driver"] == "580.95.05" and found["cuda"] == "13.0" and found["gpus"] == [GB10]
    assert found["docker_runtimes"] == ["io.containerd.runc.v2", "nvidia", "runc"] and found["toolkit"] == "1.18.0"
    assert found["rdma_core"] == "50.0-2ubuntu0.2" and found["nic_firmware"] == "28.45.4028 (NVD0000000087)"
    assert found["kernel"] == os.uname().release


def test_host_facts_says_null_for_what_the_host_cannot_say(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    tool(
        tools,
        "nvidia-smi",
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9\n",
    )
    tool(tools, "docker", "echo 'Cannot connect to the Docker daemon' >&2; exit 1\n")
    found = facts(str(tools))
    assert {key: found[key] for key in ("driver", "cuda", "gpus", "docker_runtimes", "toolkit", "nic_firmware")} == {
        "driver": None, "cuda": None, "gpus": None, "docker_runtimes": None, "toolkit": None, "nic_firmware": None}  # fmt: skip
    assert facts(str(tmp_path / "nothing"))["rdma_core"] is None


def test_the_image_probe_reads_torchs_cuda_its_gpu_code_and_nccl(tmp_path):
    site = tmp_path / "site"
    for name, version in (("torch", "2.11.0+cu130"), ("nvidia_nccl_cu13", "2.28.9")):
        (site / f"{name}-{version}.dist-info").mkdir(parents=True)
        (site / f"{name}-{version}.dist-info" / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")
    (site / "torch").mkdir()
    # as torch 2.11.0+cu130 has them (the H100's, 2026-12-06: tests/gpu/results/2026-12-06/image-probe-h100.json)
    (site / "torch" / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    (site / "torch" / "__init__.py").write_text(
        "class _C:\n    @staticmethod\n    def _cuda_getArchFlags():\n        return 'sm_75 sm_80 sm_86 sm_90 sm_100 sm_120'\n"
    )
    result = subprocess.run([sys.executable, "-"], input=script("image_probe.py"), capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}, check=True)  # fmt: skip
    found = json.loads(result.stdout)
    assert found["torch"] == "2.11.0+cu130" and found["torch_cuda"] == "13.0" and found["nccl"] == "2.28.9"
    assert found["torch_arch"] == CU130["torch_arch"]
    (site / "torch" / "version.py").write_text("cuda: Optional[str] = None\n")  # a CPU build: nothing to hold
    again = json.loads(subprocess.run([sys.executable, "-"], input=script("image_probe.py"), capture_output=True,
                                      text=True, env={"PYTHONPATH": str(site)}, check=True).stdout)  # fmt: skip
    assert again["torch_cuda"] is None and again["torch_arch"] is None


# (torch's GPU code, the GPU's compute capability, whether it runs there)
ARCH = [
    ("sm_120", "12.1", True),  # GB10: the cu130 wheels' Blackwell code (same major, lower minor)
    ("sm_120", "12.0", True),
    ("sm_121a", "12.1", True),
    ("sm_120a", "12.1", False),  # arch-specific: its own capability only
    ("sm_90a", "9.0", True),
    ("sm_90", "10.0", False),  # another major
    ("sm_86", "8.9", True),
    ("sm_89", "8.6", False),  # a higher minor
    ("compute_90", "12.1", True),  # PTX: compiled by the driver for anything newer
    ("compute_120", "9.0", False),
    ("sm_100f", "10.3", True),  # a family's
    ("sm_75 sm_80", "9.0", False),
    ("cuda", "9.0", False),  # not a flag
    ("sm_100", "10", True),
]


@pytest.mark.parametrize("arch, capability, runs", ARCH)
def test_gpu_code_runs_where_cuda_says_it_does(arch, capability, runs):
    assert arch_runs(arch.split(), capability) is runs


# (the image's CUDA, the node's driver, the driver's CUDA, what the check says)
CUDA = [
    ("13.0", "580.95.05", "13.0", None),
    ("13.0", "575.57.08", "12.9", "refuse"),
    ("13.1", "580.95.05", "13.0", "warn"),  # minor version compatibility
    ("12.8", "570.86.15", "12.8", None),
    ("12.9", "570.86.15", "12.8", "warn"),
    ("12.4", "520.61.05", "11.8", "refuse"),
    ("12.8", "580.95.05", "13.0", None),  # an older CUDA on a newer driver
    ("14.0", None, "13.0", "refuse"),  # a major the table does not know: held to the driver's CUDA
    ("13.0", "N/A", "13.0", None),
    ("13.0", None, None, None),  # the host cannot say
    (None, "470.256.02", "11.4", None),  # the image cannot say
]


@pytest.mark.parametrize("built, driver, supports, said", CUDA)
def test_the_images_cuda_against_the_driver(built, driver, supports, said):
    cfg = load_cluster_config(config())
    node = cfg.nodes[0].name
    host = HostFacts.from_json({**SPARK, "driver": driver, "cuda": supports})
    verdict = host_verdict(cfg, {node: host}, {node: ImageFacts.from_json({**CU130, "torch_cuda": built})})
    found = "refuse" if verdict.problems else "warn" if verdict.warnings else None
    assert found == said, verdict
    for line in verdict.problems + verdict.warnings:
        assert line.startswith(f"host check {node}: ") and " — " in line


def test_each_cuda_major_has_the_oldest_driver_the_compatibility_guide_names():
    assert DRIVER_FOR_CUDA == {11: 450, 12: 525, 13: 580}


@pytest.mark.parametrize("known", KNOWN_BAD, ids=lambda known: f"{known.fact}={known.value}")
def test_each_known_bad_combination_is_found_and_says_what_happens_the_fix_and_its_source(known):
    cfg = load_cluster_config(config())
    assert len(cfg.nodes) > 1 and known.verdict in ("refuse", "warn")
    assert known.what and known.fix and "(20" in known.source  # a date
    value = known.value.rstrip("*") + ("-anything" if known.value.endswith("*") else "")
    on_image = known.fact in ("nccl", "torch_cuda")
    host = HostFacts.from_json({**SPARK, **({} if on_image else {known.fact: value})})
    image = ImageFacts.from_json({**CU130, **({known.fact: value} if on_image else {})})
    name = cfg.nodes[1].name
    verdict = host_verdict(cfg, {name: host}, {name: image})
    said = verdict.problems if known.verdict == "refuse" else verdict.warnings
    assert [line for line in said if f"{known.fact} {value}" in line and known.source in line], verdict
    other = host_verdict(cfg, {name: HostFacts.from_json(SPARK)}, {name: ImageFacts.from_json(CU130)})
    assert other.problems == other.warnings == []


def test_nodes_on_different_drivers_or_kernels_warn_naming_each():
    cfg = load_cluster_config(config())
    first, second = (node.name for node in cfg.nodes[:2])
    hosts = {first: HostFacts.from_json(SPARK), second: HostFacts.from_json({**SPARK, "kernel": "6.17.0-1033-nvidia"})}
    verdict = host_verdict(cfg, hosts, {})
    assert verdict.problems == []
    assert verdict.warnings == [
        f"host check: the nodes run different kernels ({first} 6.17.0-1032-nvidia, {second} 6.17.0-1033-nvidia) — "
        "run the same kernel on every node (a difference is where a problem on one node of two starts)"
    ]


def test_without_gpus_in_the_containers_neither_the_driver_nor_the_gpu_code_is_held_to_the_image():
    cfg = load_cluster_config(config(container__gpus=False))
    node = cfg.nodes[0].name
    host = HostFacts.from_json({**SPARK, "driver": "470.256.02", "cuda": "11.4"})
    image = ImageFacts.from_json({**CU130, "torch_arch": ["sm_80"]})
    assert host_verdict(cfg, {node: host}, {node: image}) == host_verdict(cfg, {node: HostFacts.from_json(SPARK)}, {})
