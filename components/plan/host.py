"""Whether each node's host can run the image: its facts (components/scripts/host_facts.py, over SSH) against the
image's (image_probe.py, in a container of it), judged before any container. Pure (no Pulumi).

Three rules, each from its source:

* **The image's CUDA and the driver.** An application built with CUDA M.x runs on a driver of CUDA major M's minimum
  or newer (minor version compatibility, CUDA 11 on: 11.x needs 450, 12.x 525, 13.x 580; NVIDIA's CUDA
  Compatibility guide, "Minor Version Compatibility", read 2026-12-06). Below that the image's torch stops in vLLM
  with "CUDA driver version is insufficient": refused. A newer minor than the driver's own CUDA runs with a limited
  feature set (PTX built by the newer toolkit does not load): a warning.
* **The image's GPU code and the GPU.** A cubin built for sm_XY runs on a GPU of compute capability X.Z with Z >= Y
  (binary compatibility within a major; an arch-specific sm_XYa only on X.Y itself), PTX for compute_XY is compiled
  by the driver for any X.Y or newer. A torch with neither for the node's GPU stops at its first kernel with "no
  kernel image is available for execution on the device": refused. (GB10, the DGX Spark's, is 12.1: the cu130
  wheels' sm_120 code runs there.)
* **Known-bad combinations**: KNOWN_BAD below, data; each a refusal or a warning with what happens and its source.

Nodes of one deployment whose driver or kernel differ get a warning."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional

from components.config import ClusterConfig
from components.scripts.node_contract import HostFacts, ImageFacts

# The oldest driver of each CUDA major that runs any of its minors (CUDA Compatibility guide, table 1).
DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}


@dataclass(frozen=True)
class KnownBad:
    """A combination people lost days to: where it matches a node, `verdict` (refuse or warn) with `what` happens,
    `fix` and `source` (where it was reported, with its date). `applies`: whether the stack is exposed (a kernel
    that breaks RDMA matters to a stack whose NCCL uses it)."""

    fact: str  # kernel, driver, nic_firmware (the host's) or nccl, torch_cuda (the image's)
    value: str  # the fact's value, exactly; a trailing * matches a prefix
    verdict: str  # refuse or warn
    what: str
    fix: str
    source: str
    applies: Callable[[ClusterConfig], bool] = lambda cfg: True

    def matches(self, found: Optional[str]) -> bool:
        if found is None:
            return False
        return found.startswith(self.value[:-1]) if self.value.endswith("*") else found == self.value


def _rdma_between_nodes(cfg: ClusterConfig) -> bool:
    """NCCL between the nodes over RDMA: several nodes, GPUs in the containers (without, vLLM does not use NCCL),
    nccl.ibDisable off."""
    return len(cfg.nodes) > 1 and cfg.container.gpus and not cfg.nccl.ib_disable


KNOWN_BAD: tuple[KnownBad, ...] = (
    KnownBad(
        "kernel", "7.0.0-1019-nvidia", "refuse",
        "NCCL over RoCE fails at start on this DGX OS kernel: `Call to ibv_reg_mr_iova2 failed with error Cannot "
        "allocate memory` (ncclSystemError), with the model's memory free",
        "boot the previous kernel (6.17.0-1032-nvidia worked on the same machines) until a fixed one ships; or "
        "nccl.ibDisable: true (TCP, slow)",
        "MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#14 (2026-09-12), eugr/spark-vllm-docker#389 and #392 "
        "(2026-09-13), NVIDIA developer forum 'DGX Spark regression: kernel 7.0.0-1019-nvidia'",
        _rdma_between_nodes,
    ),
)  # fmt: skip


def _numbers(version: Optional[str]) -> tuple[int, ...]:
    found = re.match(r"^\s*(\d+(?:\.\d+)*)", version or "")
    return tuple(int(part) for part in found.group(1).split(".")) if found else ()


def arch_runs(arch: list[str], capability: str) -> bool:
    """Whether GPU code `arch` (torch's list: sm_90, sm_90a, compute_120 …) has something a GPU of `capability`
    ("12.1") runs: a cubin of its major and an equal or lower minor (an arch-specific "a" one of exactly it), or PTX
    of an equal or lower capability."""
    major, minor = (_numbers(capability) + (0, 0))[:2]
    for flag in arch:
        found = re.match(r"^(sm|compute)_(\d+?)(\d)([a-z]?)$", flag)
        if not found:
            continue
        kind, x, y, suffix = found.group(1), int(found.group(2)), int(found.group(3)), found.group(4)
        if kind == "compute" and (x, y) <= (major, minor):
            return True
        if kind == "sm" and x == major and (y == minor if suffix == "a" else y <= minor):
            return True
    return False


@dataclass(frozen=True)
class HostVerdict:
    problems: list[str]
    warnings: list[str]


def host_verdict(cfg: ClusterConfig, hosts: Mapping[str, HostFacts], images: Mapping[str, ImageFacts]) -> HostVerdict:
    """Every node's host against its image and the others, one line each naming the node and the fix."""
    problems: list[str] = []
    warnings: list[str] = []
    for name, host in hosts.items():
        image = images.get(name) or ImageFacts()
        where = f"host check {name}"
        if cfg.container.gpus:  # (without GPUs in the containers neither the driver nor the GPU code is used)
            problems += _cuda_problems(where, host, image, warnings) + _arch_problems(where, host, image)
        for known in KNOWN_BAD:
            found = getattr(image if known.fact in ("nccl", "torch_cuda") else host, known.fact, None)
            if known.matches(found) and known.applies(cfg):
                line = f"{where}: {known.fact} {found}: {known.what} — {known.fix} (known: {known.source})"
                (problems if known.verdict == "refuse" else warnings).append(line)
    for fact in ("driver", "kernel"):
        seen = {name: getattr(host, fact) for name, host in hosts.items() if getattr(host, fact)}
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{name} {value}" for name, value in sorted(seen.items()))
            warnings.append(
                f"host check: the nodes run different {fact}s ({listed}) — run the same {fact} on every node "
                "(a difference is where a problem on one node of two starts)"
            )
    return HostVerdict(problems, warnings)


def _arch_problems(where: str, host: HostFacts, image: ImageFacts) -> list[str]:
    """The first of the node's GPUs that the image's torch has no code for (one line: the fix is the image's)."""
    if not image.torch_arch:
        return []
    for gpu in host.gpus or []:
        if gpu.compute_cap and not arch_runs(image.torch_arch, gpu.compute_cap):
            return [
                f"{where}: the image's torch {image.torch} carries GPU code for {' '.join(image.torch_arch)} and none "
                f"that runs on the node's {gpu.name} (compute capability {gpu.compute_cap}): vLLM would stop with 'no "
                "kernel image is available for execution on the device' — use an image whose torch is built for "
                f"sm_{gpu.compute_cap.replace('.', '')} (TORCH_CUDA_ARCH_LIST)"
            ]
    return []


def _cuda_problems(where: str, host: HostFacts, image: ImageFacts, warnings: list[str]) -> list[str]:
    built, driver, supports = _numbers(image.torch_cuda), _numbers(host.driver), _numbers(host.cuda)
    if not built or not (driver or supports):
        return []
    needed = DRIVER_FOR_CUDA.get(built[0])
    too_old = (driver[0] < needed) if (needed and driver) else (bool(supports) and supports[0] < built[0])
    if too_old:
        need = f"driver {needed} or later" if needed else f"a driver for CUDA {built[0]}"
        return [
            f"{where}: the image's torch {image.torch} is built for CUDA {image.torch_cuda}, which needs NVIDIA "
            f"{need}; the node runs driver {host.driver or 'unknown'} (CUDA {host.cuda or 'unknown'}): vLLM would "
            "stop with 'CUDA driver version is insufficient' — update the node's driver, or use an image built for "
            "the CUDA it supports"
        ]
    if supports and built[:2] > supports[:2]:
        warnings.append(
            f"{where}: the image's torch is built for CUDA {image.torch_cuda} and the node's driver {host.driver} "
            f"supports CUDA {host.cuda}: it runs under minor version compatibility, with a limited feature set (PTX "
            f"the newer toolkit built does not load) — a driver for CUDA {image.torch_cuda} or later avoids it"
        )
    return []


# What a release records of the hosts it ran on (its `hosts`): record key -> the fact of HostFacts
HOST_RECORD = {"kernel": "kernel", "os": "os", "driver": "driver", "cuda": "cuda", "toolkit": "toolkit",
               "rdmaCore": "rdma_core", "nicFirmware": "nic_firmware"}  # fmt: skip


def host_record(hosts: Mapping[str, dict]) -> dict[str, list[str]]:
    """Each fact's values over the nodes (the host check's finding: node -> facts), distinct and sorted, what a host
    could not say left out; the GPUs as "name (compute capability)"."""
    record = {
        key: sorted({str(facts[fact]) for facts in hosts.values() if facts.get(fact)})
        for key, fact in HOST_RECORD.items()
    }
    record["gpus"] = sorted(
        {
            f"{gpu['name']} ({gpu.get('compute_cap') or '?'})"
            for facts in hosts.values()
            for gpu in facts.get("gpus") or []
        }
    )
    return record


def host_differences(validated: Optional[dict], here: dict) -> dict[str, tuple[list, list]]:
    """Where this stack's hosts differ from those a release was validated on: fact -> (there, here), for each fact
    both sides know (a release from before hosts were recorded: none)."""
    if not isinstance(validated, dict):
        return {}
    return {
        key: (list(validated[key]), list(here[key]))
        for key in here
        if validated.get(key) and here.get(key) and set(validated[key]) != set(here[key])
    }


def promotion_host_verdict(cfg: ClusterConfig, origin: str, validated: Optional[dict], here: dict) -> HostVerdict:
    """A promoted release's hosts against this stack's: a difference in a fact release.sameHosts names is refused,
    any other is a warning, each naming both sides."""
    problems, warnings = [], []
    for key, (there, mine) in sorted(host_differences(validated, here).items()):
        line = (
            f"promoteFrom {origin!r}: {key} {', '.join(there)} where the release was validated, {', '.join(mine)} here"
        )
        if key in cfg.release.same_hosts:
            problems.append(f"{line} (release.sameHosts) — bring this stack's nodes to what {origin} ran, or validate "
                            f"the release on hosts like these first")  # fmt: skip
        else:
            warnings.append(line)
    return HostVerdict(problems, warnings)
