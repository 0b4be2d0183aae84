"""The model's fingerprint: components/scripts/model_fingerprint.py on each node (its files' sizes and hashes, its
config.json's keys); every node must hold the same model. The memory plan reads the head's."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig
from components.plan.preflight import compare_fingerprints, fingerprint_argv, model_path, parse_fingerprint
from components.plan.programs import script
from components.plan.shell import shell_line, with_script
from components.resources.checks.protocol import Check, OnNode, Stage


class PreflightError(Exception):
    """The nodes hold different models (or one lacks it): one line a difference."""


def same_model(stdouts_by_node: dict[str, str]) -> str:
    """The fingerprint every node found for the model; PreflightError naming the differences."""
    found = {node: parse_fingerprint(out) for node, out in stdouts_by_node.items()}
    problems = compare_fingerprints(found)
    if problems:
        raise PreflightError("\n".join(problems))
    return next(iter(found.values())).fingerprint or ""


class ModelFingerprint(Check):
    name = "model-fingerprint"
    stage = Stage.NODE

    def wanted(self, cfg: ClusterConfig) -> bool:
        """A directory to read now (a repo id is read once downloaded, or by vLLM)."""
        return bool(model_path(cfg.model) or cfg.promote_from or cfg.downloads_once)

    def command(self, on: OnNode) -> pulumi.Input[str]:
        return on.model.apply(
            lambda model: (
                with_script(shell_line(fingerprint_argv(model)), script("model_fingerprint.py"))
                if model_path(model)
                else "echo '{}'"
            )
        )

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        return [on.model, *on.reread]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> str:
        return same_model(outs)
