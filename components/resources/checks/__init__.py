"""The checks every node passes before any container starts, in the order they run. Each is a step on the node
and a judge of every node's result (protocol.py); components/resources/node_checks.py runs this list and
components/resources/gate.py collects the verdicts. A new check: one module here and one line below."""

from __future__ import annotations

from components.resources.checks.fabric_gate import FabricGate
from components.resources.checks.gpu_check import GpuCheck
from components.resources.checks.host_check import HostCheck
from components.resources.checks.image_check import ImageCheck
from components.resources.checks.model_fingerprint import ModelFingerprint
from components.resources.checks.nccl import NcclTest
from components.resources.checks.preflight import Preflight
from components.resources.checks.protocol import NodeCheck, OnNode, Stage

CHECKS: tuple[NodeCheck, ...] = (
    FabricGate(),
    Preflight(),  # the first NODE check: the node's others run once it passed
    ModelFingerprint(),
    ImageCheck(),
    HostCheck(),  # reads the image check's facts
    GpuCheck(),
    NcclTest(),
)

__all__ = ["CHECKS", "NodeCheck", "OnNode", "Stage"]
