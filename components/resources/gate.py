"""A replica's gate before any container: its nodes' checks (components/resources/checks/, run by
components/resources/node_checks.py: the stack's fabric stage first, then each node's, then those across its nodes), the
image every node runs and the memory plan; judged together, so that one node's failure leaves nothing
half-started anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig
from components.plan.engine import EngineSettings
from components.plan.host import host_record, promotion_host_verdict
from components.plan.memory import MemoryPlanError
from components.plan.memory import message as memory_message
from components.plan.preflight import (
    VllmRefusesError,
    held_to,
    memory_plan,
    parse_fingerprint,
    vllm_record,
    vllm_refusals,
)
from components.plan.shell import shell_line
from components.plan.speculation import SpeculationError, speculation_problems
from components.plan.speculation import message as speculation_message
from components.resources.checks import OnNode
from components.resources.checks.host_check import HostCheck
from components.resources.checks.image_check import ImageCheck
from components.resources.checks.model_fingerprint import ModelFingerprint
from components.resources.checks.preflight import Preflight
from components.resources.depot import Receiver, snapshot_of
from components.resources.node import NodeHost
from components.resources.node_checks import (
    FabricVerdict,
    NodeChecks,
    NodeChecksArgs,
    across_stage,
    checked_fabric,
    fabric_stage,
    node_stage,
)
from components.resources.release import ReleaseSource
from components.resources.transfer import Transfer


class ImageMismatchError(Exception):
    pass


def gate_line(nodes: int, image_id: str, model_fingerprint: str) -> str:
    """The gate's command: it only records, on the deploying machine, what every node agreed on."""
    model = f"model {model_fingerprint[:16]}" if model_fingerprint else "model by repo id"
    return shell_line(["echo", f"{nodes} node(s) checked: image {image_id}, {model}"])


def same_image(ids_by_node: dict[str, str]) -> str:
    """The one image id every node runs, or an error naming the nodes that differ."""
    distinct = sorted(set(ids_by_node.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{node}: {image}" for node, image in sorted(ids_by_node.items()))
        raise ImageMismatchError(
            f"the image differs between nodes ({listing}); the tag moved between pulls or a node has a "
            "locally built image: pin `image` by digest (name@sha256:…) or re-pull on every node"
        )
    return distinct[0]


@dataclass(frozen=True)
class Gate:
    """What the checks left for the containers and the outputs."""

    passed: command.local.Command  # exists once every node passed and all agree: the head container waits on it
    checks: dict[str, NodeChecks]
    fabric: pulumi.Output  # the fabric gate's figures (with nccl, the test's too)
    memory_plan: pulumi.Output  # the `memoryPlan` output; fails the gate when the model does not fit
    image_id: pulumi.Output[str]  # the one image id every node runs
    vllm: pulumi.Output  # the image's vLLM and the rules it is held to (vllm_found)
    hosts: pulumi.Output  # what the nodes' hosts run, as the release records it (hosts_found)


def checked_model(release: ReleaseSource, transfer: Transfer) -> pulumi.Output[str]:
    """What the checks read on each node: the model, or a downloaded repo id's snapshot directory (the same
    path on every node once synced), so it is fingerprinted and compared like a directory."""
    if transfer.download is not None:
        return transfer.download.stdout.apply(snapshot_of)
    return pulumi.Output.from_input(release.model)


def create_fabric_gate(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
) -> FabricVerdict:
    """The fabric of every node of the stack, checked once before anything else runs there (the FABRIC checks)."""
    networks = [h.fabric_network for h in hosts.values() if h.fabric_network is not None]
    model = checked_model(release, transfer)
    on = {node.name: OnNode(cfg, node, release.image, None, model) for node in cfg.nodes}
    return fabric_stage(parent, cfg, on, {name: host.connection for name, host in hosts.items()}, networks)


def create_gate(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    fabric_verdict: FabricVerdict,
    co_tenants: Optional[dict[str, list[str]]] = None,
    key: str = "vllm",
) -> Gate:
    """A replica's gate, which its head container waits for: it exists only once every node passed its checks
    (NODE, then ACROSS) and all agree on the image and the model, and the model fits (the memory plan).

    The gate is a resource of its own, so the head container depends on it without taking data
    from it: in a preview where a node is added (its checks not run yet) the head's inputs stay
    known and the preview shows the head as it will be, untouched.
    """
    networks = [h.fabric_network for h in hosts.values() if h.fabric_network is not None]
    names = [node.name for node in cfg.nodes]
    same_image_id = pulumi.Output.all(*[transfer.images[n].image_id for n in names]).apply(
        lambda ids: same_image(dict(zip(names, ids, strict=True)))
    )
    model = checked_model(release, transfer)
    # peers must have their fabric address before we ping them; nothing runs on a node on a bad fabric
    before = [*networks, *([fabric_verdict.passed] if fabric_verdict.passed is not None else [])]
    checks = _node_checks(parent, cfg, release, hosts, transfer, model, before)
    found = node_stage(cfg, checks, fabric_verdict.found)
    found = across_stage(parent, cfg, checks, {n: hosts[n].connection for n in names}, found)
    vllm = vllm_found(cfg, release, checks, found, key)
    host = hosts_found(cfg, release, found)
    plan = _memory_plan(cfg, release, checks, found, vllm, co_tenants or {}, key)
    # Each verdict and the plan only have to have passed (they raise when not): a bool joins the gate, not a
    # finding, whose per-node dict Output.all would unwrap into an Output per key.
    passed_all = [found[name].apply(lambda _: True) for name in found if name not in fabric_verdict.found]
    model_id = found.get(ModelFingerprint.name, pulumi.Output.from_input(""))
    line = pulumi.Output.all(
        image_id=same_image_id, model_id=model_id, plan=plan.apply(lambda _: True), vllm=vllm,
        host=host.apply(lambda _: True), verdicts=pulumi.Output.all(*passed_all),
    ).apply(lambda found: gate_line(len(cfg.nodes), found["image_id"], found["model_id"]))  # fmt: skip
    passed = command.local.Command(
        cfg.named("checks-passed", alone="spark-vllm"), create=line, opts=pulumi.ResourceOptions(parent=parent)
    )
    figures = checked_fabric(found, fabric_verdict.figures)
    return Gate(
        passed=passed, checks=checks, fabric=figures, memory_plan=plan, image_id=same_image_id, vllm=vllm, hosts=host
    )


class HostPromotionError(Exception):
    """This stack's hosts differ from those the promoted release was validated on, in a fact release.sameHosts
    names."""


def hosts_found(cfg: ClusterConfig, release: ReleaseSource, found: dict[str, pulumi.Output]) -> pulumi.Output:
    """What the replica's hosts run (the host check's facts as a release records them); with promoteFrom, held to
    the hosts the release was validated on (components/plan/host.py promotion_host_verdict): a difference
    release.sameHosts names is refused before any container, any other is a warning."""
    validated = release.hosts if release.hosts is not None else pulumi.Output.from_input(None)

    def judge(facts: dict, validated: Optional[dict]) -> dict:
        record = host_record(facts)
        verdict = promotion_host_verdict(cfg, release.origin, validated, record)
        if verdict.problems:
            raise HostPromotionError("\n".join(verdict.problems))
        for warning in verdict.warnings:
            pulumi.log.warn(warning)
        return record

    return pulumi.Output.all(facts=found[HostCheck.name], validated=validated).apply(lambda each: judge(**each))


def vllm_found(
    cfg: ClusterConfig,
    release: ReleaseSource,
    checks: dict[str, NodeChecks],
    found: dict[str, pulumi.Output],
    key: str = "vllm",
) -> pulumi.Output:
    """The vLLM of the image the nodes agreed on (the head's image check: every node runs the same id) and the rules
    of components/config/vllm_versions.py it is held to, as the release records them; a promoted release validated
    under other rules for that vLLM (this program reads it otherwise now), and engine settings that vLLM refuses at
    start (`key`: where they are, `deployments[2].vllm`), are refused before any container."""
    head = checks[cfg.head_node.name].stdout(ImageCheck.name)
    validated = release.vllm if release.vllm is not None else pulumi.Output.from_input(None)

    def judge(head: str, validated: Optional[dict], engine: EngineSettings, checked: Any) -> dict:
        record = vllm_record(head, validated, release.origin)
        refused = vllm_refusals(held_to(record), list(engine.extra_args), key)
        if refused:
            raise VllmRefusesError("\n".join(refused))
        return record

    # `checked`: the image check's verdict, which has to have passed first
    found_all = pulumi.Output.all(head=head, validated=validated, engine=release.engine, checked=found[ImageCheck.name])
    return found_all.apply(lambda each: judge(**each))


def _node_checks(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    model: pulumi.Output[str],
    before: list,
) -> dict[str, NodeChecks]:
    """Every node's checks (after `before`), the copy source's first; with modelSync each other node's
    copy of the model from the source first, and checked again once a new copy arrived."""
    source = cfg.copy_source
    syncing = cfg.model_sync.enabled and transfer.depot is not None
    checks: dict[str, NodeChecks] = {}
    source_model = None
    ordered = [source, *(n for n in cfg.nodes if n.name != source.name)] if source in cfg.nodes else list(cfg.nodes)
    for node in ordered:
        after: list[pulumi.Resource] = list(before)
        reread: list[pulumi.Input] = []
        if node is source and transfer.download is not None:
            after.append(transfer.download)
        if syncing and source_model is not None:
            at = Receiver(node.name, node, hosts[node.name].connection, parent)
            after.append(transfer.depot.sync_model(at, transfer.synced_model, source_model))
            reread.append(source_model)  # a new copy: check and fingerprint it again
        on = OnNode(cfg, node, release.image, transfer.images[node.name].image_id, model, tuple(reread))
        checks[node.name] = NodeChecks(
            cfg.named(node.name),
            NodeChecksArgs(on=on, connection=hosts[node.name].connection, after=after),
            opts=pulumi.ResourceOptions(parent=parent),
        )
        fingerprint = checks[node.name].stdout(ModelFingerprint.name)
        if syncing and node is source and fingerprint is not None:
            source_model = fingerprint.apply(lambda out: parse_fingerprint(out).fingerprint or "")
    return {node.name: checks[node.name] for node in cfg.nodes}


def _speculation_checked(fingerprint: str, engine: EngineSettings, key: str) -> bool:
    """The release's vllm.speculative against the model's config.json (any memoryCheck): SpeculationError,
    before any container, where vLLM would refuse it at start; `key`: where that vllm section is
    (`deployments[2].vllm`)."""
    config = parse_fingerprint(fingerprint).config
    problems = speculation_problems(config, engine.speculative, f"{key}.speculative")
    if problems:
        raise SpeculationError(speculation_message(problems))
    return True


def _memory_plan(
    cfg: ClusterConfig,
    release: ReleaseSource,
    checks: dict[str, NodeChecks],
    found: dict[str, pulumi.Output],
    vllm: pulumi.Output,
    co_tenants: dict[str, list[str]],
    key: str = "vllm",
) -> pulumi.Output:
    """The memory plan from the head's model fingerprint and every node's memory; with
    memoryCheck enforce, an error (before any container) when it does not fit. A replica with `co_tenants`
    (node -> the other replicas there) gets its KV cache pinned to what the plan gives it."""
    fingerprint = checks[cfg.head_node.name].stdout(ModelFingerprint.name)
    if fingerprint is None:
        return pulumi.Output.from_input(
            {"checked": False, "reason": "the model is a repo id: its size is known only once downloaded"}
        )
    if cfg.memory_check == "off":
        return pulumi.Output.all(fingerprint=fingerprint, engine=release.engine).apply(
            lambda found: _speculation_checked(**found, key=key) and {"checked": False, "reason": "memoryCheck: off"}
        )

    def judge(head: str, engine: EngineSettings, memories: dict, found_vllm: Optional[dict]) -> dict:
        _speculation_checked(head, engine, key)
        plan = memory_plan(
            cfg, head, [memories[node.name] for node in cfg.nodes], engine, pin_kv_cache=bool(co_tenants),
            vllm=held_to(found_vllm),
        )  # fmt: skip
        for note in plan.notes():
            pulumi.log.info(cfg.said(note))
        if not plan.fits:
            if cfg.memory_check == "enforce":
                raise MemoryPlanError(memory_message(plan))
            pulumi.log.warn(
                memory_message(plan).replace("(memoryCheck: enforce); nothing was started", "(memoryCheck: warn)")
            )
        output = {"checked": True, **plan.output()}
        if co_tenants:
            output["coTenants"] = co_tenants
        return output

    memories = found[Preflight.name]
    found_all = pulumi.Output.all(head=fingerprint, engine=release.engine, memories=memories, found_vllm=vllm)
    return found_all.apply(lambda each: judge(**each))
