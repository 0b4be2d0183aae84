"""Rules that only exist with several deployments: what the router exposes and whether it reaches every
replica, served model names the router could confuse, names that collide once joined with a node's,
replica ports beyond the last port, what a stack with deployments cannot have. Registered rules
(components/config/runner.py), each declaring the keys it reads (`deployments[].vllm.port`); each judges
the deployments `placed` gives it (named once, on known nodes, replicas dividing them: the others have
their own problems, components/config/replicas.py) and returns its problems, one line each (key path,
value found, what is expected)."""

from __future__ import annotations

from typing import Any

from components.config.deployments import node_groups, replica_name
from components.config.errors import problem
from components.config.runner import rule
from components.config.vllm_args import read_extra_args

LAST_PORT = 65535
# Names the stack's own resources and containers take (components/resources/router.py, components/plan/names.py):
# a deployment named so would read as one of them in `pulumi preview`, the logs and the diagnostics bundle.
RESERVED_NAMES = ("spark-vllm", "router")


# What `placed` reads: every rule below that judges deployments declares these too.
PLACED = ("nodes[].name", "deployments[].name", "deployments[].nodes", "deployments[].replicas")


def _firsts(cfg: Any) -> list[Any]:
    """The first deployment of each name (names_unique names the others)."""
    firsts: dict[str, Any] = {}
    for each in cfg.deployments:
        firsts.setdefault(each.name, each)
    return list(firsts.values())


def _misplaced(deployment: Any, known: list[str]) -> list[str]:
    """A deployment's nodes (known, each once) and replicas (dividing them into equal groups)."""
    at, nodes = f"deployments[{deployment.index}]", list(deployment.nodes)
    missing = [name for name in nodes if name not in known]
    twice = sorted({name for name in nodes if nodes.count(name) > 1})
    problems = []
    if missing:
        problems.append(problem(f"{at}.nodes", nodes, f"names from nodes ({known}): {missing} is not one"))
    if twice:
        problems.append(problem(f"{at}.nodes", nodes, f"each node once ({twice} twice)"))
    if len(nodes) > 1 and len(nodes) % deployment.replicas:
        problems.append(
            problem(
                f"{at}.replicas",
                deployment.replicas,
                f"a number that divides its {len(nodes)} nodes into equal groups, one a replica (or list one "
                "node for all of its replicas)",
            )
        )
    return problems


def placed(cfg: Any) -> list[tuple[int, Any]]:
    """(index, deployment) of the deployments the rules judge: the first of each name, placed as
    nodes_known_and_divided asks (components/config/replicas.py names the others)."""
    known = sorted(node.name for node in cfg.nodes)
    return [(each.index, each) for each in _firsts(cfg) if not _misplaced(each, known)]


@rule("deployments[].name")
def names_unique(cfg: Any) -> list[str]:
    first: dict[str, int] = {}
    problems = []
    for deployment in cfg.deployments:
        if deployment.name in first:
            problems.append(
                problem(
                    f"deployments[{deployment.index}].name",
                    deployment.name,
                    f"a unique name (deployments[{first[deployment.name]}] has it)",
                )
            )
        first.setdefault(deployment.name, deployment.index)
    return problems


@rule(*PLACED)
def nodes_known_and_divided(cfg: Any) -> list[str]:
    known = sorted(node.name for node in cfg.nodes)
    return [line for each in _firsts(cfg) for line in _misplaced(each, known)]


@rule("deployments[].name", "deployments[].replicas")
def replica_names_free(cfg: Any) -> list[str]:
    """Replica k > 1 of a deployment is <name>-<k>: no deployment may be named so."""
    first: dict[str, int] = {}
    for deployment in cfg.deployments:
        first.setdefault(deployment.name, deployment.index)
    problems = []
    for deployment in cfg.deployments:
        for k in range(1, deployment.replicas):
            taken = replica_name(deployment.name, k)
            if taken in first:
                problems.append(
                    problem(
                        f"deployments[{first[taken]}].name",
                        taken,
                        f"a name no replica has: deployments[{deployment.index}] ({deployment.name}) names its "
                        f"replica {k + 1} {taken}",
                    )
                )
    return problems


def _groups(deployment: Any) -> list[list[str]]:
    return node_groups(list(deployment.nodes), deployment.replicas)


def _replica_name(deployment: Any, k: int) -> str:
    return replica_name(deployment.name, k)


@rule(*PLACED, "deployments[].vllm.port", deferred=True)
def replica_ports_fit(cfg: Any) -> list[str]:
    """Replicas sharing their one node listen on vllm.port + k (k = 0 … replicas − 1): the last must be a port."""
    problems = []
    for index, deployment in placed(cfg):
        if len(deployment.nodes) != 1 or deployment.replicas == 1:
            continue
        last = deployment.vllm.port + deployment.replicas - 1
        if last > LAST_PORT:
            problems.append(
                problem(
                    f"deployments[{index}].vllm.port",
                    deployment.vllm.port,
                    f"at most {LAST_PORT - deployment.replicas + 1}: its {deployment.replicas} replicas on node "
                    f"{deployment.nodes[0]} listen on vllm.port + 0 … {deployment.replicas - 1}, and "
                    f"{_replica_name(deployment, deployment.replicas - 1)} would take {last} "
                    f"(ports end at {LAST_PORT})",
                )
            )
    return problems


@rule(*PLACED, "deployments[].vllm.servedModelName", "deployments[].model", deferred=True)
def served_names_unique(cfg: Any) -> list[str]:
    """The router sends a request to the replicas of the model it names: two deployments serving one name would
    share requests (a coder's prompt answered by the small model). The name is vllm.servedModelName, else the
    model (none yet with promoteFrom: the promoted release's model decides, checked where it is known)."""
    problems: list[str] = []
    seen: dict[str, int] = {}
    for index, deployment in placed(cfg):
        served = deployment.vllm.served_model_name or deployment.model
        if served is None:
            continue
        if served in seen:
            key = "vllm.servedModelName" if deployment.vllm.served_model_name else "model"
            problems.append(
                problem(
                    f"deployments[{index}].{key}",
                    served,
                    f"a served model name of its own: deployments[{seen[served]}] serves {served!r} too, and the "
                    "router routes by that name (set vllm.servedModelName on one of them)",
                )
            )
            continue
        seen[served] = index
    return problems


@rule(*PLACED, "nodes[*].name", deferred=True)
def names_apart(cfg: Any) -> list[str]:
    """A replica's resources and containers on a node are named `<replica>-<node>` (spark-vllm-<replica>-<node>):
    two such joins that spell the same (`qwen` on `big-spark`, `qwen-big` on `spark`) would be one container
    name and one resource twice. And the stack's own names are not a deployment's."""
    problems: list[str] = []
    joined: dict[str, tuple[int, str, str]] = {}
    for index, deployment in placed(cfg):
        if deployment.name in RESERVED_NAMES or deployment.name.startswith(tuple(f"{n}-" for n in RESERVED_NAMES)):
            problems.append(
                problem(
                    f"deployments[{index}].name",
                    deployment.name,
                    f"a name the stack's own resources do not take (they are named {', '.join(RESERVED_NAMES)} and "
                    f"{RESERVED_NAMES[0]}-…: the router, its steps, its container and volume)",
                )
            )
        for k, group in enumerate(_groups(deployment)):
            replica = _replica_name(deployment, k)
            for node in group:
                name = f"{replica}-{node}"
                other = joined.get(name)
                if other is not None and other[1:] != (replica, node):
                    problems.append(
                        problem(
                            f"deployments[{index}].name",
                            deployment.name,
                            f"a name that stays apart from the others once joined with a node's: replica {replica} on "
                            f"node {node} and replica {other[1]} on node {other[2]} (deployments[{other[0]}]) are both "
                            f"{name} (container spark-vllm-{name}, resources {name}-…): rename one",
                        )
                    )
                joined.setdefault(name, (index, replica, node))
    return list(dict.fromkeys(problems))


@rule(
    "router.enabled",
    "router.allowUnauthenticated",
    "router.host",
    "router.node",
    "router.port",
    "apiKey",
    "apiKeys",
    deferred=True,
)
def router_exposes_nothing(cfg: Any) -> list[str]:
    """The router listens beyond loopback (router.host 0.0.0.0 or the fabric address): without the stack's apiKey
    every model behind it answers anyone who reaches that port, even where each vLLM is only on loopback or
    allowed to serve without a key on its own address."""
    router = cfg.router
    if not router.enabled or cfg.api_key is not None or cfg.api_keys or router.allow_unauthenticated:
        return []
    where = "every address" if router.host == "0.0.0.0" else "the fabric address"
    return [
        problem(
            "apiKey",
            None,
            f"a secret (`pulumi config set --secret apiKey …`) because the router serves every model behind it on "
            f"{where} of node {router.node} (router.host {router.host!r}, port {router.port}) and vLLM checks the "
            "key it passes on; or set router.allowUnauthenticated: true to serve them to the network without one",
        )
    ]


@rule(*PLACED, "router.enabled", deferred=True)
def several_replicas_have_the_router(cfg: Any) -> list[str]:
    """The edge in front of the endpoint has one upstream: one vLLM, or vllm-router in front of several (each
    vLLM listens on its head's fabric address only, components/plan/endpoint.py)."""
    count = sum(deployment.replicas for _, deployment in placed(cfg))
    if cfg.router.enabled or count < 2:
        return []
    return [
        problem(
            "router.enabled",
            False,
            f"on (its default here) with {count} replicas: the endpoint's edge sends every request to vllm-router, "
            "which routes it by its model; no vLLM listens on the network by itself",
        )
    ]


REACH = ("nodes[*].fabricAddress", "deployments[].vllm.host")


@rule(*PLACED, *REACH, "router.enabled", "router.node", deferred=True)
def router_reaches_replicas(cfg: Any) -> list[str]:
    """The router sends each request to a replica's API server: one listening on loopback of another node never
    answers it (network.guard lets every node's fabric address in: network.apiSources limits the edge alone)."""
    router = cfg.router
    home = next((node for node in cfg.nodes if node.name == router.node), None)
    if not router.enabled or home is None:
        return []
    found = []
    for index, deployment in placed(cfg):
        away = [group[0] for group in _groups(deployment) if group[0] != home.name]
        if away:  # a replica on the router's own node is reached on loopback
            found += _unreached(index, deployment, away[0], home, "router.node")
    return list(dict.fromkeys(found))


@rule(*PLACED, *REACH, "metrics.prometheusNode", deferred=True)
def prometheus_reaches_replicas(cfg: Any) -> list[str]:
    """metrics.prometheusNode on a node a replica does not run on still scrapes that replica's head (on one it
    runs on, the replica view's own rule checks it)."""
    scraper = next((node for node in cfg.nodes if node.name == cfg.metrics.prometheus_node), None)
    if scraper is None:
        return []
    found = []
    for index, deployment in placed(cfg):
        if scraper.name not in deployment.nodes:
            found += _unreached(index, deployment, deployment.nodes[0], scraper, "metrics.prometheusNode")
    return list(dict.fromkeys(found))


def unreached(host_key: str, host: Any, server: str, client: Any, client_key: str) -> list[str]:
    """What keeps `client` (a node, named by `client_key`) from `server` (an API server on another node, whose
    bind `host` is `host_key`): a loopback bind. (vLLM listens on its head's fabric address, behind the edge:
    network.guard lets every node's fabric address reach it, whatever network.apiSources says.)"""
    if host.is_loopback:
        return [
            problem(
                host_key,
                str(host),
                f"an address {client_key} {client.name} reaches: {server} would listen on its loopback only "
                "(0.0.0.0, the default: the head's fabric address)",
            )
        ]
    return []


def _unreached(index: int, deployment: Any, head: str, client: Any, client_key: str) -> list[str]:
    server = f"{deployment.name}'s API server on node {head}"
    return unreached(f"deployments[{index}].vllm.host", deployment.vllm.host, server, client, client_key)


# vLLM 0.25's flag for a KV cache set in bytes; argparse takes any unique prefix of it, the shortest being
# --kv-cache-mem (--kv-cache-me is also --kv-cache-metrics: tests/gpu/results/2026-12-03/vllm-0.25.0-serve-flags.json)
KV_BYTES_FLAG, KV_BYTES_SHORTEST = "--kv-cache-memory-bytes", "--kv-cache-mem"


@rule(*PLACED, "deployments[].vllm.extraArgs", deferred=True)
def pinned_kv_cache_is_the_plans(cfg: Any) -> list[str]:
    """A replica that shares its GPU with another gets its KV cache in bytes from its memory plan: the same flag in
    its extraArgs would take that from the plan (and from the node's other replicas, whose plans assume it)."""
    usable = placed(cfg)
    shared = {}
    for index, deployment in usable:
        for group in _groups(deployment):
            for node in group:
                shared.setdefault(node, []).append(index)
    problems = []
    for index, deployment in usable:
        if not any(len(shared[node]) > 1 for group in _groups(deployment) for node in group):
            continue
        for arg in read_extra_args(list(deployment.vllm.extra_args)).args:
            flag = arg.flag or ""
            if len(flag) >= len(KV_BYTES_SHORTEST) and KV_BYTES_FLAG.startswith(flag):
                problems.append(
                    problem(
                        f"deployments[{index}].vllm.extraArgs[{arg.index}]",
                        arg.text,
                        f"no {KV_BYTES_FLAG}: {deployment.name} shares a GPU with another replica, so the memory plan "
                        "sets its KV cache in bytes (what the plan gives it, vllm.gpuMemoryUtilization's share); "
                        "change that share instead",
                    )
                )
    return problems


@rule("deployments[].name", "fabric.bandwidthTest", "fabric.gate", deferred=True)
def fabric_tested_once(cfg: Any) -> list[str]:
    """With deployments the fabric gate checks the stack's links once; the NCCL test runs in a single-model stack."""
    if not cfg.deployments or cfg.fabric.bandwidth_test != "nccl" or cfg.fabric.gate == "off":
        return []
    return [
        problem(
            "fabric.bandwidthTest",
            "nccl",
            "tcp with deployments (the fabric gate checks the stack's links once; the NCCL test runs in a "
            "single-model stack)",
        )
    ]


@rule("deployments[].name", "modelSync.enabled", deferred=True)
def models_already_there(cfg: Any) -> list[str]:
    """modelSync copies one model, a single-model stack's."""
    if not cfg.deployments or not cfg.model_sync.enabled:
        return []
    return [
        problem(
            "modelSync.enabled",
            True,
            "false with deployments: each deployment's model must be on its nodes already (a directory) or be "
            "a repo id vLLM downloads (modelSync copies one model, a single-model stack's)",
        )
    ]
