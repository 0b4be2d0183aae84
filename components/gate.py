"""The gate before any container: every node's checks (the fabric gate first, then preflight, the GPU
in a container, the image, the model's fingerprint), with fabric.bandwidthTest nccl the NCCL test, and
the memory plan; judged together, so that one node's failure leaves nothing half-started anywhere."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command

from components import fabric
from components.checks import NodeChecks, NodeChecksArgs, fabric_gate_probe
from components.config import ClusterConfig
from components.depot import snapshot_of, sync_model
from components.engine import EngineSettings
from components.memory import MemoryPlanError
from components.memory import message as memory_message
from components.node import NodeHost
from components.preflight import compare_fingerprints, image_problems, image_warnings, memory_plan, parse_fingerprint
from components.release import ReleaseSource
from components.render import script_program, shell_line, with_script
from components.speculation import SpeculationError, speculation_problems
from components.speculation import message as speculation_message
from components.steps import remote_step
from components.transfer import Transfer


class ImageMismatchError(Exception):
    pass


class PreflightError(Exception):
    pass


class ImageCheckError(Exception):
    """The image on one or more nodes lacks what the config needs; one line a problem, each with its fix."""


def image_fit(cfg: ClusterConfig, stdouts_by_node: dict[str, str]) -> bool:
    """True when every node's image holds what the config needs; ImageCheckError listing every problem."""
    problems = [line for node in cfg.nodes for line in image_problems(cfg, node, stdouts_by_node[node.name])]
    if problems:
        raise ImageCheckError("\n".join(problems))
    for node in cfg.nodes:
        for warning in image_warnings(node, stdouts_by_node[node.name]):
            pulumi.log.warn(warning)
    return True


def same_model(stdouts_by_node: dict[str, str]) -> str:
    """The fingerprint every node found for the model; PreflightError naming the differences."""
    found = {node: parse_fingerprint(out) for node, out in stdouts_by_node.items()}
    problems = compare_fingerprints(found)
    if problems:
        raise PreflightError("\n".join(problems))
    return next(iter(found.values())).get("fingerprint", "")


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


@dataclass(frozen=True)
class FabricVerdict:
    """The fabric gate's (and with nccl the NCCL test's) figures, and what exists once it passed."""

    figures: pulumi.Output
    passed: Optional[command.local.Command]
    nccl_passed: pulumi.Output


def create_fabric_gate(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    checks: Optional[dict[str, NodeChecks]] = None,
    images: Optional[dict] = None,
    model: pulumi.Input[str] = "",
) -> FabricVerdict:
    """The fabric of every node, checked once for the stack: the gate's probes and, with
    fabric.bandwidthTest nccl (after `checks` saw the GPUs), the NCCL test."""
    networks = [h.fabric_network for h in hosts.values() if h.fabric_network is not None]
    figures, passed = _fabric_gate(parent, cfg, release, hosts, networks, model)
    nccl_passed = pulumi.Output.from_input(True)
    if fabric.nccl_test(cfg) and checks is not None and images is not None:
        figures, nccl_passed = _nccl_test(parent, cfg, hosts, checks, images, model, figures)
    return FabricVerdict(figures, passed, nccl_passed)


def create_gate(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    shared_fabric: Optional[FabricVerdict] = None,
    co_tenants: Optional[dict[str, list[str]]] = None,
    key: str = "vllm",
) -> Gate:
    """Every node's checks, and the gate the head's Ray container waits for: it exists only once
    every node passed its checks and all agree on the image and the model.

    The gate is a resource of its own, so the head container depends on it without taking data
    from it: in a preview where a node is added (its checks not run yet) the head's inputs stay
    known and the preview shows the head as it will be, untouched.
    """
    networks = [h.fabric_network for h in hosts.values() if h.fabric_network is not None]
    images = transfer.images
    names = [node.name for node in cfg.nodes]
    same_image_id = pulumi.Output.all(*[images[n].image_id for n in names]).apply(
        lambda ids: same_image(dict(zip(names, ids, strict=True)))
    )
    # What the checks read on each node: the model, or a downloaded repo id's snapshot directory
    # (the same path on every node once synced), so it is fingerprinted and compared like a directory.
    local_model = release.model
    if transfer.download is not None:
        local_model = transfer.download.stdout.apply(snapshot_of)
    if shared_fabric is None:
        figures, fabric_passed = _fabric_gate(parent, cfg, release, hosts, networks, local_model)
    else:  # with deployments: the stack's fabric, checked once for every replica
        figures, fabric_passed = shared_fabric.figures, shared_fabric.passed
    prefix = cfg.name_prefix
    # peers must have their fabric address before we ping them; nothing runs on a node on a bad fabric
    before = [*networks, *([fabric_passed] if fabric_passed is not None else [])]
    checks = _node_checks(parent, cfg, hosts, transfer, local_model, before)
    gates = [each.passed for each in checks.values()]
    fingerprints = {name: c.fingerprint for name, c in checks.items() if c.fingerprint is not None}
    model_id = _same_model_id(fingerprints)
    plan = _memory_plan(cfg, release, checks, fingerprints, co_tenants or {}, key)
    nccl_passed = pulumi.Output.from_input(True)
    if shared_fabric is not None:
        nccl_passed = shared_fabric.nccl_passed
    elif fabric.nccl_test(cfg):
        figures, nccl_passed = _nccl_test(parent, cfg, hosts, checks, images, local_model, figures)
    images_fit = pulumi.Output.all(*[checks[n].image_facts for n in names]).apply(
        lambda outs: image_fit(cfg, dict(zip(names, outs, strict=True)))
    )
    # The plan only has to have passed (it raises when it does not fit): a bool joins the gate, not
    # the plan, whose per-node dict Output.all would unwrap into an Output per key.
    planned = plan.apply(lambda _: True)
    verdict = pulumi.Output.all(same_image_id, model_id, planned, images_fit, nccl_passed, *gates).apply(
        lambda parts: gate_line(len(cfg.nodes), parts[0], parts[1])
    )
    passed = command.local.Command(
        f"{prefix}-checks-passed" if prefix else "spark-vllm-checks-passed",
        create=verdict,
        opts=pulumi.ResourceOptions(parent=parent),
    )
    return Gate(passed=passed, checks=checks, fabric=figures, memory_plan=plan, image_id=same_image_id)


def _same_model_id(fingerprints: dict[str, pulumi.Output[str]]) -> pulumi.Output[str]:
    """The model every node holds ("" when none was fingerprinted: a repo id not downloaded yet)."""
    if not fingerprints:
        return pulumi.Output.from_input("")
    names = list(fingerprints)
    return pulumi.Output.all(*fingerprints.values()).apply(lambda outs: same_model(dict(zip(names, outs, strict=True))))


def _node_checks(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    local_model: pulumi.Input[str],
    before: list,
) -> dict[str, NodeChecks]:
    """Every node's checks (after `before`), the copy source's first; with modelSync each other node's
    copy of the model from the source first, and checked again once a new copy arrived."""
    source = cfg.copy_source
    syncing = cfg.model_sync.enabled and transfer.depot is not None
    prefix = cfg.name_prefix
    checks: dict[str, NodeChecks] = {}
    source_model = None
    ordered = [source, *(n for n in cfg.nodes if n.name != source.name)] if source in cfg.nodes else list(cfg.nodes)
    for node in ordered:
        after: list[pulumi.Resource] = list(before)
        reread: list[pulumi.Input] = []
        if node is source and transfer.download is not None:
            after.append(transfer.download)
        if syncing and source_model is not None:
            connection = hosts[node.name].connection
            after.append(
                sync_model(
                    node.name, cfg, node, transfer.depot, transfer.synced_model, source_model, connection, parent=parent
                )
            )
            reread.append(source_model)  # a new copy: check and fingerprint it again
        checks[node.name] = NodeChecks(
            f"{prefix}-{node.name}" if prefix else node.name,
            NodeChecksArgs(
                config=cfg,
                node=node,
                connection=hosts[node.name].connection,
                image_id=transfer.images[node.name].image_id,
                model=local_model,
                after=after,
                reread=reread,
            ),
            opts=pulumi.ResourceOptions(parent=parent),
        )
        if syncing and node is source and checks[node.name].fingerprint is not None:
            source_model = checks[node.name].fingerprint.apply(
                lambda out: parse_fingerprint(out).get("fingerprint", "")
            )
    return {node.name: checks[node.name] for node in cfg.nodes}


def _fabric_gate(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    networks: list,
    model: pulumi.Input[str],
) -> tuple[pulumi.Output, Optional[command.local.Command]]:
    """Every node's fabric probe, judged together by `spark-vllm-fabric-passed`: with fabric.gate
    enforce its input fails listing every problem, so it never exists and nothing after it (the
    checks, the containers) runs. (The figures, the resource or None when the gate is off.)"""
    if cfg.fabric.gate == "off":
        return pulumi.Output.from_input({"checked": False, "reason": "fabric.gate: off"}), None
    names = [node.name for node in cfg.nodes]
    # a new release runs on a freshly checked fabric; the image as named is known before any pull
    triggers = [release.image, model]
    probes = [
        fabric_gate_probe(cfg, node, hosts[node.name].connection, triggers, networks, parent) for node in cfg.nodes
    ]

    def judge(outs: list[str]) -> dict:
        facts = {}
        for name, out in zip(names, outs, strict=True):
            try:
                facts[name] = parse_fingerprint(out)
            except ValueError as error:
                facts[name] = {"error": f"{error}: {out.strip()[:200]!r}"}
        problems, figures = fabric.judge(cfg, facts)
        fabric.enforce(cfg, problems, pulumi.log.warn)
        return {**figures, "problems": problems}

    figures = pulumi.Output.all(*[probe.stdout for probe in probes]).apply(judge)
    passed = command.local.Command(
        "spark-vllm-fabric-passed",
        create=figures.apply(lambda f: shell_line(["echo", f"fabric: {fabric.describe(f)}"])),
        opts=pulumi.ResourceOptions(parent=parent),
    )
    return figures, passed


def _nccl_test(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    hosts: dict[str, NodeHost],
    checks: dict[str, NodeChecks],
    images: dict,
    model: pulumi.Input[str],
    gate_figures: pulumi.Output,
) -> tuple[pulumi.Output, pulumi.Output]:
    """fabric.bandwidthTest: nccl: `<node>-fabric-nccl` on every node at once, in its image on its
    GPUs, once every node passed its checks (the GPU visible in a container, the image pulled);
    judged with the gate's figures. (The fabric figures with the test's, and its verdict.)"""
    checked = [r for c in checks.values() for r in (c.preflight, c.gpu) if r is not None]
    image_ids = [images[node.name].image_id for node in cfg.nodes]
    tests = []
    for index, node in enumerate(cfg.nodes):
        program = script_program("nccl_bandwidth.py", fabric.nccl_params(cfg, node))
        tests.append(
            remote_step(
                f"{node.name}-fabric-nccl",
                hosts[node.name].connection,
                image_ids[index].apply(
                    lambda image, node=node, program=program: with_script(
                        shell_line(fabric.nccl_argv(cfg, node, image)), program
                    )
                ),
                # every node's test must run together: any node's new image runs them all again
                triggers=[*image_ids, model],
                parent=parent,
                depends_on=checked,
            )
        )
    names = [node.name for node in cfg.nodes]

    def judge(parts: list) -> dict:
        gate, *outs = parts
        facts = {}
        for name, out in zip(names, outs, strict=True):
            lines = [line for line in out.splitlines() if line.strip()]
            try:
                facts[name] = json.loads(lines[-1])
            except (IndexError, ValueError):
                facts[name] = {"error": f"the test printed no result: {out.strip()[-300:]!r}"}
        problems, figures = fabric.judge_nccl(cfg, facts, gate.get("links") or {})
        fabric.enforce(cfg, problems, pulumi.log.warn)
        return fabric.with_nccl(gate, figures, problems)

    merged = pulumi.Output.all(gate_figures, *[test.stdout for test in tests]).apply(judge)
    return merged, merged.apply(lambda _: True)


def _speculation_checked(fingerprint: str, engine: EngineSettings, key: str) -> bool:
    """The release's vllm.speculative against the model's config.json (any memoryCheck): SpeculationError,
    before any container, where vLLM would refuse it at start; `key`: where that vllm section is
    (`deployments[2].vllm`)."""
    config = parse_fingerprint(fingerprint).get("config") or {}
    problems = speculation_problems(config, engine.speculative, f"{key}.speculative")
    if problems:
        raise SpeculationError(speculation_message(problems))
    return True


def _memory_plan(
    cfg: ClusterConfig,
    release: ReleaseSource,
    checks: dict[str, NodeChecks],
    fingerprints: dict,
    co_tenants: dict[str, list[str]],
    key: str = "vllm",
) -> pulumi.Output:
    """The memory plan from the head's model fingerprint and every node's memory; with
    memoryCheck enforce, an error (before any container) when it does not fit. A replica with `co_tenants`
    (node -> the other replicas there) gets its KV cache pinned to what the plan gives it."""
    if cfg.head_node.name not in fingerprints:
        return pulumi.Output.from_input(
            {"checked": False, "reason": "the model is a repo id: its size is known only once downloaded"}
        )
    if cfg.memory_check == "off":
        return pulumi.Output.all(fingerprints[cfg.head_node.name], release.engine).apply(
            lambda parts: _speculation_checked(*parts, key) and {"checked": False, "reason": "memoryCheck: off"}
        )
    memories = [each.memory for each in checks.values()]

    def judge(parts: list) -> dict:
        fingerprint, engine, *found = parts
        _speculation_checked(fingerprint, engine, key)
        plan = memory_plan(cfg, fingerprint, found, engine, pin_kv_cache=bool(co_tenants))
        for note in plan.notes():
            pulumi.log.info(f"{cfg.name_prefix}: {note}" if cfg.name_prefix else note)
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

    return pulumi.Output.all(fingerprints[cfg.head_node.name], release.engine, *memories).apply(judge)
