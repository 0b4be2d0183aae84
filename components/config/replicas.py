"""Where each deployment runs: its replicas (a group of nodes each), and each replica as a ClusterConfig of
its own (a view: its nodes, head, model, parallelism, executor, `vllm` and `ray`), which the program's rooms
take as they take a single-model stack. A stack without `deployments` is one replica, the config itself,
named "" (its resources keep their names).

Also the rules that hold across deployments: every single-model rule on each replica's view (its problems
under `deployments[i].…`), the names, the nodes, the ports two deployments share on a node, and the
memory: the gpuMemoryUtilization of everything on one node together."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

from pydantic import BaseModel

from components.config.deployment_rules import PLACED, placed
from components.config.deployments import SINGLE_MODEL_KEYS, node_groups, replica_name
from components.config.errors import problem
from components.config.listeners import EPHEMERAL_KEY, RAY_CLIENT_KEY, Listener, node_listeners
from components.config.models import ClusterConfig
from components.config.runner import FAILED, View, failed_keys, skipped

# The rules that read these keys describe one model: with deployments they run on each replica's view.
DEPLOYMENT_ROOTS = (*(key for key, _ in SINGLE_MODEL_KEYS), "smokeTest", "benchmark")
# What a view's problem path starts with when it is the deployment's (prefixed deployments[i].): a key of
# one model's settings (`head` is the deployment's nodes)
_VIEW_PATH = re.compile(rf"^(?:{'|'.join(key for key, _ in SINGLE_MODEL_KEYS if key != 'head')})(?=[.\[: ]|$)")


@dataclass(frozen=True)
class Replica:
    """One copy of one deployment on its group of nodes (or the whole single-model stack)."""

    name: str  # resource and container prefix: "" for a single-model stack, else <deployment> or <deployment>-<k>
    deployment: Optional[str]  # the deployment's name; None for a single-model stack
    deployment_index: Optional[int]
    index: int  # 0 for the first replica
    config: Any  # a ClusterConfig: the view

    @property
    def own(self) -> bool:
        """Whether it serves the stack's own model (a single-model stack's top-level keys), not a listed deployment."""
        return self.deployment is None

    def key(self, path: str) -> str:
        """Where `path` (a key of one model's settings: `vllm`, `vllm.speculative`) is in the stack file."""
        return path if self.deployment_index is None else f"deployments[{self.deployment_index}].{path}"

    def labels(self) -> dict[str, str]:
        """Its metrics' labels: its head; a listed deployment's also name it and the replica."""
        head = {"node": self.config.head_node.name}
        return head if self.own else {**head, "deployment": self.deployment, "replica": self.name}


def _replace(source: Any, **update: Any) -> Any:
    """`source` with these fields: a model copy of a ClusterConfig (no validation: every part of it already
    passed), or the partial view the rules get of an invalid one."""
    if isinstance(source, BaseModel):
        return source.model_copy(update=update)
    return SimpleNamespace(**{**vars(source), **update})


def _vllm_of(deployment: Any, index: int) -> Any:
    """Replica `index`'s vllm settings: replicas that share their one node listen on vllm.port + index
    (and masterPort + index)."""
    vllm = deployment.vllm
    if index == 0 or len(deployment.nodes) != 1:
        return vllm
    return _replace(vllm, port=vllm.port + index, master_port=vllm.master_port + index)


def view(cfg: Any, deployment: Any, nodes: list[Any], name: str, index: int = 0) -> Any:
    """`cfg` as replica `index` of `deployment` sees it: a single-model config on `nodes`."""
    update = {
        "nodes": nodes,
        "head": nodes[0].name,
        "model": deployment.model,
        "tensor_parallel_size": deployment.tensor_parallel_size,
        "pipeline_parallel_size": deployment.pipeline_parallel_size,
        "max_model_len": deployment.max_model_len,
        "executor": deployment.executor,
        "vllm": _vllm_of(deployment, index),
        "ray": deployment.ray,
        "deployments": [],
    }
    if isinstance(cfg, BaseModel):
        # The image and the model reach every node once, for the whole stack (components/resources/transfer.py):
        # a replica copies nothing itself.
        update["fabric_copy"] = cfg.fabric_copy.model_copy(update={"source": None})
        update["model_sync"] = cfg.model_sync.model_copy(update={"enabled": False})
        update["image_transfer"] = cfg.image_transfer.model_copy(update={"method": "pull"})
    made = _replace(cfg, **update)
    if isinstance(made, BaseModel):
        made._replica = name
    return made


def replicas_of(cfg: Any) -> list[Replica]:
    """Every replica of every deployment, in order; a single-model stack's one."""
    if not cfg.deployments:
        return [Replica("", None, None, 0, cfg)]
    by_name = {node.name: node for node in cfg.nodes}
    found = []
    for d_index, deployment in enumerate(cfg.deployments):
        for index, group in enumerate(node_groups(list(deployment.nodes), deployment.replicas)):
            name = replica_name(deployment.name, index)
            nodes = [by_name[node] for node in group]
            found.append(Replica(name, deployment.name, d_index, index, view(cfg, deployment, nodes, name, index)))
    return found


def on_node(cfg: Any, node: str) -> list[Replica]:
    """The replicas that run on `node`."""
    return [each for each in replicas_of(cfg) if any(n.name == node for n in each.config.nodes)]


def co_tenants(cfg: Any, replica: Replica) -> dict[str, list[Replica]]:
    """The other replicas on each of `replica`'s nodes that share one (nothing for a single-model stack): vLLMs
    whose start must not overlap its own (the node's GPU turn) and whose KV caches the memory plan pins."""
    found = {}
    for node in replica.config.nodes:
        others = [each for each in on_node(cfg, node.name) if each.name != replica.name]
        if others:
            found[node.name] = others
    return found


def stack_listeners(cfg: Any, index: int) -> list[Listener]:
    """What listens on node `index` for the whole stack: with deployments, each replica's listeners there
    (keys under deployments[i]) and the stack's own (sshd, the fabric gate's test, Prometheus, the router…)."""
    if not cfg.deployments:
        return node_listeners(cfg, index)
    return [item for item, _ in _listeners_on(cfg, index, list(enumerate(cfg.deployments)))]


def _own(key: str) -> bool:
    """Whether a listener of a replica's view is the stack's own (sshd, the gate's test, the router…)."""
    return not _VIEW_PATH.match(key) and key not in (RAY_CLIENT_KEY, EPHEMERAL_KEY)


def _listeners_on(cfg: Any, index: int, usable: list) -> list[tuple[Listener, Optional[tuple[int, str]]]]:
    """Everything listening on node `index`, each with its owner ((deployment index, replica name), None for the
    stack's own),
    keyed as the stack file spells it: a replica's under deployments[i], a node's under its index in `nodes`
    (not its place among the replica's nodes: the worker half of one deployment is another's head)."""
    node = cfg.nodes[index]
    found = [(item, None) for item in node_listeners(cfg, index) if _own(item.key)]
    by_name = {each.name: each for each in cfg.nodes}
    for d_index, deployment in usable:
        for k, group in enumerate(node_groups(list(deployment.nodes), deployment.replicas)):
            if node.name not in group:
                continue
            name = replica_name(deployment.name, k)
            replica_view = view(cfg, deployment, [by_name[n] for n in group], "", k)
            for item in node_listeners(replica_view, group.index(node.name)):
                if _own(item.key):
                    continue  # the stack's, listed once above
                key = f"deployments[{d_index}].{item.key}" if _VIEW_PATH.match(item.key) else item.key
                listener = Listener(key, f"{item.what} of {name}", item.first, item.last, item.default)
                if not any(listener == seen for seen, _ in found):
                    found.append((listener, (d_index, name)))
    return found


# --- the rules ---------------------------------------------------------------------------------------


def _valid(value: Any) -> bool:
    if value is FAILED:
        return False
    if isinstance(value, SimpleNamespace):
        return all(_valid(v) for k, v in vars(value).items() if k != "raw")
    if isinstance(value, list):
        return all(_valid(v) for v in value)
    return True


def _set(cfg: Any, field: str) -> bool:
    """Whether the stack sets a top-level key to something else than its default (Pulumi passes the
    defaults Pulumi.yaml declares, so a key present with its default is as good as absent)."""
    value = getattr(cfg, field, None)
    return _valid(value) and value != ClusterConfig.model_fields[field].get_default(call_default_factory=True)


def deployment_problems(cfg: Any, run_view: Any) -> list[str]:
    """What the registered rules cannot say of `deployments` (`cfg` a ClusterConfig or the partial view of one):
    the single-model keys set beside them, and every single-model rule on each replica's view (`run_view(view)`
    runs them) with what replicas sharing a node need there, for the deployments `placed` keeps whose own
    fields are all valid."""
    deployments = cfg.deployments
    if not isinstance(deployments, list) or not deployments:
        return []
    problems = [
        problem(key, _shown(cfg, field), "no value beside deployments: each deployment sets its own")
        for key, field in SINGLE_MODEL_KEYS
        if _set(cfg, field)
    ]
    nodes = cfg.nodes if isinstance(cfg.nodes, list) else []
    if not nodes or skipped(PLACED, failed_keys(cfg)):
        return problems
    node_index = {node.name: index for index, node in enumerate(nodes) if _valid(node) or _valid(node.name)}
    kept = placed(View(cfg, frozenset(PLACED)))
    usable = [(index, deployments[index]) for index, _ in kept if _valid(deployments[index])]
    problems += _view_problems(cfg, usable, node_index, run_view)
    return problems + _shared_node_problems(cfg, usable)


def _shown(cfg: Any, field: str) -> Any:
    """The value as the stack file has it: the same line whether the config or only its keys were read."""
    value = getattr(cfg, field, None)
    if not isinstance(value, (BaseModel, SimpleNamespace)):
        return value
    raw = getattr(cfg, "raw", None)
    if isinstance(raw, dict):
        return raw.get(next(key for key, name in SINGLE_MODEL_KEYS if name == field))
    return value.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def _view_problems(cfg: Any, usable: list, node_index: dict[str, int], run_view: Any) -> list[str]:
    """The single-model rules on each replica's view, their problems under deployments[i]."""
    problems: list[str] = []
    by_name = {node.name: node for node in cfg.nodes if _valid(node.name)}
    for index, deployment in usable:
        for k, group in enumerate(node_groups(list(deployment.nodes), deployment.replicas)):
            local = [by_name[name] for name in group]
            found = run_view(view(cfg, deployment, local, replica_name(deployment.name, k), k))
            for line in found:
                line = re.sub(
                    r"nodes\[(\d+)\]", lambda m, group=group: f"nodes[{node_index[group[int(m.group(1))]]}]", line
                )
                if _VIEW_PATH.match(line):
                    line = f"deployments[{index}].{line}"
                elif line.startswith("head:"):
                    line = f"deployments[{index}].nodes" + line[len("head") :]
                if line not in problems:
                    problems.append(line)
    return problems


def _shared_node_problems(cfg: Any, usable: list) -> list[str]:
    """On each node: the ports of everything there (each deployment's, the stack's: a node that runs only the
    router, Prometheus or the copy depot too), and the GPU memory every deployment there asks for."""
    problems: list[str] = []
    by_name = {node.name: node for node in cfg.nodes if _valid(node.name)}
    for index, node in enumerate(cfg.nodes):
        if not _valid(node) or not all(_valid(each) for each in cfg.nodes):
            continue  # its own fields' problems are listed; its ports cannot be judged
        here = []  # (deployment index, deployment, replica k, its view, this node's index among the view's nodes)
        for d_index, deployment in usable:
            for k, group in enumerate(node_groups(list(deployment.nodes), deployment.replicas)):
                if node.name in group:
                    local = [by_name[name] for name in group]
                    here.append((d_index, deployment, k, view(cfg, deployment, local, "", k), group.index(node.name)))
        lines = _port_clashes(node, _listeners_on(cfg, index, usable), bool(here))
        lines += _memory_together(cfg, node, here) if len(here) > 1 else []
        for line in lines:
            if not any(seen.split(": ")[0] == line.split(": ")[0] for seen in problems):
                problems.append(line)  # one line a key: a range on every node of a replica is one mistake
    return problems


def _port_clashes(
    node: Any, listeners: list[tuple[Listener, Optional[tuple[int, str]]]], replicas_here: bool
) -> list[str]:
    """Two listeners of different owners on one port. The clashes inside one replica's view (its own ports, and
    the stack's on its nodes) are the view rules' to tell; a node without replicas has only the stack's."""
    problems: list[str] = []
    for later, (listener, owner) in enumerate(listeners):
        for other, other_owner in listeners[:later]:
            if not other.overlaps(listener) or EPHEMERAL_KEY in (other.key, listener.key):
                continue  # the kernel hands out an ephemeral port once; two Ray clusters share the range
            if replicas_here and (owner is None or other_owner is None or owner == other_owner):
                continue  # inside one replica's view: its rules name it
            blamed = listener if listener.key.startswith("deployments[") else other
            if any(line.startswith(f"{blamed.key}: ") for line in problems):
                continue  # one line a key on a node: its message names what it collides with
            if blamed.key == RAY_CLIENT_KEY:
                problems.append(
                    problem(
                        f"deployments[{owner[0]}].executor",
                        "ray",
                        f"one Ray head on node {node.name}: {other.what} and {listener.what} both take port "
                        f"{listener.first}, which Ray fixes (its client server, with ray[client]): run one of them "
                        "with executor mp, or put its first node elsewhere",
                    )
                )
                continue
            problems.append(
                problem(
                    blamed.key,
                    blamed.first,
                    f"a port nothing else on node {node.name} listens on: {other} and {listener} collide "
                    "(deployments sharing a node need their own ports there)"
                    if replicas_here
                    else f"a port nothing else on node {node.name} listens on: {other} and {listener} collide",
                )
            )
    return problems


def _memory_together(cfg: Any, node: Any, here: list) -> list[str]:
    """Each vLLM on a node takes gpuMemoryUtilization of its GPUs (of a GB10's memory): together at most all."""
    asked = [(index, replica_name(deployment.name, k), deployment.vllm.gpu_memory_utilization)
             for index, deployment, k, _, _ in here]  # fmt: skip
    total = sum(fraction for _, _, fraction in asked)
    if total <= 1:
        return []
    listing = " + ".join(f"{name} {fraction:g} (deployments[{index}].vllm.gpuMemoryUtilization)"
                         for index, name, fraction in asked)  # fmt: skip
    return [
        problem(
            f"deployments[{asked[-1][0]}].vllm.gpuMemoryUtilization",
            asked[-1][2],
            f"budgets that fit node {node.name} together: {listing} = {total:g} of its GPU memory, more than all "
            "of it: lower them (the memory plan then checks each against the node's memory and the OS's reserve)",
        )
    ]
