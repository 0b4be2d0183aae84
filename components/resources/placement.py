"""What several deployments need beyond what each replica does as a single-model stack would: each
deployment's release (its model and engine settings; the image is the stack's), the check that the
replicas sharing a node fit there together (against the memory the nodes reported), what starts a
replica's rolling change, and the outputs that list every deployment."""

from __future__ import annotations

from typing import Any, Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig
from components.config.replicas import Replica
from components.plan.container import node_env, supervisor_params
from components.plan.endpoint import vllm_url
from components.plan.shell import fingerprint, shell_line
from components.resources.release import ReleaseSource, release_source, stack_release_record

GIB_DIGITS = 2


class PlacementError(Exception):
    """Replicas that share a node do not fit there together."""


def deployment_releases(replicas: list[Replica]) -> dict[Optional[str], ReleaseSource]:
    """Each deployment's release (from its own keys, or with promoteFrom that stack's release of the
    deployment of the same name), by its name; a single-model stack's (its top-level keys) under None."""
    return {each.deployment: release_source(each.config, each.deployment) for each in replicas if each.index == 0}


def stack_release(releases: dict[Optional[str], ReleaseSource]) -> ReleaseSource:
    """What the stack as a whole takes: the image (one for every deployment) and the model it copies to
    every node and checks the fabric with: a single-model stack's own (modelSync moves that one only), none
    with deployments."""
    if None in releases:
        return releases[None]
    first = next(iter(releases.values()))
    return ReleaseSource(
        image=first.image, model=pulumi.Output.from_input(""), engine=pulumi.Output.from_input({}), origin=first.origin
    )


def served_name(cfg: ClusterConfig, release: ReleaseSource) -> pulumi.Output[str]:
    return release.model.apply(lambda model: cfg.vllm.served_model_name or model)


def replica_triggers(cfg: ClusterConfig, release: ReleaseSource, transfer: Any) -> list:
    """What changes a replica (its containers or vLLM's settings): each change takes it out of the router
    first. The image on its nodes, its model and engine settings, and what its containers are made of."""
    made_of = {
        "nodes": {node.name: [node_env(cfg, node), supervisor_params(cfg, node)] for node in cfg.nodes},
        "container": cfg.container.model_dump(mode="json"),
        "vllm": cfg.vllm.model_dump(mode="json"),
        "parallel": [cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.max_model_len, cfg.executor],
        "memory": cfg.memory.model_dump(mode="json"),
        "recovery": cfg.recovery.model_dump(mode="json"),
    }
    return [
        *[transfer.images[node.name].image_id for node in cfg.nodes],
        release.model,
        release.engine.apply(lambda engine: fingerprint(engine.release())),
        fingerprint(made_of),
    ]


def together(cfg: ClusterConfig, plans: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(problems, figures) of the replicas sharing each node: their budgets (gpuMemoryUtilization × the
    memory the node reported) together within its memory, less the OS's reserve on unified memory. `plans`:
    each replica's memory plan output; a plan that was not made (memoryCheck off, a repo id) is skipped."""
    reserve = cfg.memory.os_reserve_gib
    by_node: dict[str, list[tuple[str, dict]]] = {}
    for replica, plan in plans.items():
        if not isinstance(plan, dict) or not plan.get("checked"):
            continue
        for node, figures in (plan.get("nodes") or {}).items():
            by_node.setdefault(node, []).append((replica, figures))
    problems, figures = [], {}
    for node, shared in by_node.items():
        if len(shared) < 2:
            continue
        memory = max(each["memory_gib"] for _, each in shared)
        unified = any(each.get("os_left_gib") is not None for _, each in shared)
        room = memory - (reserve if unified else 0)
        total = round(sum(each["budget_gib"] for _, each in shared), GIB_DIGITS)
        figures[node] = {
            "replicas": {replica: each["budget_gib"] for replica, each in shared},
            "budgetsGib": total,
            "memoryGib": memory,
            "osReserveGib": reserve if unified else None,
        }
        if unified and reserve >= memory:
            problems.append(
                f"node {node}: memory.osReserveGib {reserve:g} is the whole of its {memory} GiB of unified memory or "
                "more, so no deployment fits there: set it to what the operating system needs (the default is 8 GiB)"
            )
        elif total > room:
            listing = " + ".join(f"{replica} {each['budget_gib']} GiB" for replica, each in shared)
            less = f" less the OS's reserve of {reserve:g} GiB (memory.osReserveGib)" if unified else ""
            problems.append(
                f"node {node}: {listing} = {total} GiB, more than its {memory} GiB{less}: lower "
                "gpuMemoryUtilization of these deployments (each vLLM takes its fraction of the node's memory)"
            )
    return problems, figures


def together_check(
    parent: pulumi.Resource, cfg: ClusterConfig, replicas: list[Replica], gates: dict[str, Any]
) -> command.local.Command:
    """`spark-vllm-placement`: exists once the replicas sharing each node fit there together; every
    replica's head container waits for it, so a refusal leaves nothing started."""
    names = [replica.name for replica in replicas]

    def judge(plans: list) -> str:
        problems, figures = together(cfg, dict(zip(names, plans, strict=True)))
        if problems and cfg.memory_check == "enforce":
            raise PlacementError(
                "the deployments sharing a node do not fit there together (memoryCheck: enforce); nothing was "
                "started:\n" + "\n".join(f"  - {line}" for line in problems)
            )
        for line in problems:
            pulumi.log.warn(f"{line} (memoryCheck: {cfg.memory_check})")
        # the same line whatever the figures (the memoryPlan output has them): judged at every run, and a
        # change to one deployment re-runs nothing the others wait on
        return shell_line(["echo", "every replica fits its nodes"])

    verdict = pulumi.Output.all(*[gates[name].memory_plan for name in names]).apply(judge)
    return command.local.Command("spark-vllm-placement", create=verdict, opts=pulumi.ResourceOptions(parent=parent))


def deployments_release(records: dict[str, pulumi.Output], fabric: pulumi.Output) -> pulumi.Output:
    """The stack's release with deployments: each deployment's record (model, engine, validated, its
    benchmark), the one image, validated when every deployment is, and the fabric it ran on."""
    names = list(records)
    return pulumi.Output.all(*records.values()).apply(
        lambda found: fabric.apply(lambda figures: stack_release_record(dict(zip(names, found, strict=True)), figures))
    )


def deployments_output(cfg: ClusterConfig, runs: list) -> dict[str, Any]:
    """The `deployments` output: each deployment's model, settings and replicas (endpoint, head, nodes,
    containers, smoke test)."""
    found: dict[str, Any] = {}
    for run in runs:
        replica, rcfg = run.replica, run.replica.config
        entry = found.setdefault(
            replica.deployment,
            {
                "servedModelName": run.server.served_model_name,
                "model": run.release.model,
                "executor": rcfg.executor,
                "tensorParallelSize": rcfg.tensor_parallel_size,
                "pipelineParallelSize": rcfg.pipeline_parallel_size,
                "replicas": [],
            },
        )
        head = rcfg.head_node
        entry["replicas"].append(
            {
                "name": replica.name,
                "endpoint": f"{vllm_url(rcfg)}/v1",  # on the fabric: from the nodes, not the network
                "head": head.name,
                "nodes": [node.name for node in rcfg.nodes],
                "containers": run.containers,
                "smoke": run.server.smoke_result,
            }
        )
    return found
