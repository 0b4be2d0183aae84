"""The checks every node passes before any container starts, in the order they run. Each is a step on the node
and a judge of every node's result (components/checks/protocol.py); components/gate.py runs this list and
collects the verdicts. A new check: one module here and one line below."""

from __future__ import annotations

from components.checks.fabric_gate import FabricGate
from components.checks.gpu_check import GpuCheck
from components.checks.image_check import ImageCheck
from components.checks.model_fingerprint import ModelFingerprint
from components.checks.nccl_test import NcclTest
from components.checks.preflight import Preflight
from components.checks.protocol import NodeCheck, OnNode, Stage

CHECKS: tuple[NodeCheck, ...] = (
    FabricGate(),
    Preflight(),  # the first NODE check: the node's others run once it passed
    ModelFingerprint(),
    ImageCheck(),
    GpuCheck(),
    NcclTest(),
)

__all__ = ["CHECKS", "NodeCheck", "OnNode", "Stage"]
