"""Rules that only exist with several deployments: what the router exposes and whether it reaches every
replica, served model names the router could confuse, names that collide once joined with a node's, and
replica ports beyond the last port. Each returns its problems, one line each (key path, value found, what
is expected); components/config/replicas.py runs them on the deployments whose own fields are valid
(`usable`: (index, deployment) pairs), the config being a ClusterConfig or the partial view of one."""

from __future__ import annotations

from typing import Any

from components.config.deployments import node_groups, replica_name
from components.config.errors import problem
from components.config.vllm_args import read_extra_args

LAST_PORT = 65535
# Names the stack's own resources and containers take (components/resources/router.py, components/plan/names.py):
# a deployment named so would read as one of them in `pulumi preview`, the logs and the diagnostics bundle.
RESERVED_NAMES = ("spark-vllm", "router")


def _groups(deployment: Any) -> list[list[str]]:
    return node_groups(list(deployment.nodes), deployment.replicas)


def _replica_name(deployment: Any, k: int) -> str:
    return replica_name(deployment.name, k)


def replica_ports_fit(usable: list) -> list[str]:
    """Replicas sharing their one node listen on vllm.port + k (k = 0 … replicas − 1): the last must be a port."""
    problems = []
    for index, deployment in usable:
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


def served_names_unique(usable: list) -> list[str]:
    """The router sends a request to the replicas of the model it names: two deployments serving one name would
    share requests (a coder's prompt answered by the small model). The name is vllm.servedModelName, else the
    model (none yet with promoteFrom: the promoted release's model decides, checked where it is known)."""
    problems: list[str] = []
    seen: dict[str, int] = {}
    for index, deployment in usable:
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


def names_apart(cfg: Any, usable: list) -> list[str]:
    """A replica's resources and containers on a node are named `<replica>-<node>` (spark-vllm-<replica>-<node>):
    two such joins that spell the same (`qwen` on `big-spark`, `qwen-big` on `spark`) would be one container
    name and one resource twice. And the stack's own names are not a deployment's."""
    problems: list[str] = []
    joined: dict[str, tuple[int, str, str]] = {}
    for index, deployment in usable:
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


def router_exposes_nothing(cfg: Any) -> list[str]:
    """The router listens beyond loopback (router.host 0.0.0.0 or the fabric address): without the stack's apiKey
    every model behind it answers anyone who reaches that port, even where each vLLM is only on loopback or
    allowed to serve without a key on its own address."""
    router = cfg.router
    if not router.enabled or cfg.api_key is not None or router.allow_unauthenticated:
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


def router_reaches_replicas(cfg: Any, usable: list) -> list[str]:
    """The router sends each request to a replica's API server: one listening on loopback of another node, or
    fenced by network.guard from the router node's fabric address, never answers it."""
    router = cfg.router
    home = next((node for node in cfg.nodes if node.name == router.node), None)
    if not router.enabled or home is None:
        return []
    sources = cfg.network.api_sources if cfg.network.guard else []
    found = []
    for index, deployment in usable:
        away = [group[0] for group in _groups(deployment) if group[0] != home.name]
        if away:  # a replica on the router's own node is reached on loopback
            found += _unreached(index, deployment, away[0], home, "router.node", "the router that sends it requests",
                                sources)  # fmt: skip
    return list(dict.fromkeys(found))


def prometheus_reaches_replicas(cfg: Any, usable: list) -> list[str]:
    """metrics.prometheusNode on a node a replica does not run on still scrapes that replica's head (on one it
    runs on, the replica view's own rule checks it)."""
    scraper = next((node for node in cfg.nodes if node.name == cfg.metrics.prometheus_node), None)
    if scraper is None:
        return []
    found = []
    for index, deployment in usable:
        if scraper.name not in deployment.nodes:
            found += _unreached(index, deployment, deployment.nodes[0], scraper, "metrics.prometheusNode",
                                "its Prometheus that scrapes /metrics there", cfg.network.api_sources)  # fmt: skip
    return list(dict.fromkeys(found))


def _unreached(index: int, deployment: Any, head: str, client: Any, client_key: str, who: str, sources) -> list[str]:
    """What keeps `client` (a node) from a deployment's API server on node `head`: a loopback bind, or a guard
    whose network.apiSources leave the client's fabric address out."""
    host = deployment.vllm.host
    if host.is_loopback:
        return [
            problem(
                f"deployments[{index}].vllm.host",
                str(host),
                f"an address {client_key} {client.name} reaches: {deployment.name}'s API server on node {head} "
                "would listen on its loopback only (0.0.0.0, the default, or that node's fabric address)",
            )
        ]
    if sources and not any(client.fabric_address in source for source in sources):
        return [
            problem(
                "network.apiSources",
                [str(source) for source in sources],
                f"a network holding {client.fabric_address}, {client_key} {client.name}'s fabric address: the guard "
                f"would fence {deployment.name}'s API server on node {head} from {who}",
            )
        ]
    return []


# vLLM 0.25's flag for a KV cache set in bytes; argparse takes any unique prefix of it, the shortest being
# --kv-cache-mem (--kv-cache-me is also --kv-cache-metrics: tests/gpu/results/2026-12-03/vllm-0.25.0-serve-flags.json)
KV_BYTES_FLAG, KV_BYTES_SHORTEST = "--kv-cache-memory-bytes", "--kv-cache-mem"


def pinned_kv_cache_is_the_plans(usable: list) -> list[str]:
    """A replica that shares its GPU with another gets its KV cache in bytes from its memory plan: the same flag in
    its extraArgs would take that from the plan (and from the node's other replicas, whose plans assume it)."""
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


def single_model_router_problems(cfg: Any, valid: Any) -> list[str]:
    """A single-model stack may put the router in front of its one replica too (router.enabled): the same rules of
    exposure and reach, under the single-model keys."""
    router = cfg.router
    if not valid(router) or not router.enabled or not isinstance(cfg.nodes, list):
        return []
    problems = router_exposes_nothing(cfg) if valid(cfg.api_key) else []
    nodes = {node.name: node for node in cfg.nodes if valid(node)}
    home = nodes.get(router.node)
    head = cfg.head if valid(cfg.head) and cfg.head is not None else (cfg.nodes[0].name if cfg.nodes else None)
    if home is None or head is None or head == home.name or not valid(cfg.vllm) or not valid(cfg.network):
        return problems
    host = cfg.vllm.host
    if host.is_loopback:
        problems.append(
            problem(
                "vllm.host",
                str(host),
                f"an address router.node {home.name} reaches: vLLM on the head ({head}) would listen on its loopback "
                "only (0.0.0.0, the default, or the head's fabric address)",
            )
        )
    elif (
        cfg.network.guard
        and cfg.network.api_sources
        and not any(home.fabric_address in source for source in cfg.network.api_sources)
    ):
        problems.append(
            problem(
                "network.apiSources",
                [str(source) for source in cfg.network.api_sources],
                f"a network holding {home.fabric_address}, router.node {home.name}'s fabric address: the guard would "
                f"fence vLLM on the head ({head}) from the router that sends it requests",
            )
        )
    return problems


def fleet_problems(cfg: Any, usable: list, valid: Any) -> list[str]:
    """Every rule above whose keys are valid (`valid(value)`: the runner's judgement of a partial view)."""
    problems = replica_ports_fit(usable) + served_names_unique(usable) + pinned_kv_cache_is_the_plans(usable)
    if all(valid(node.name) for node in cfg.nodes):
        problems += names_apart(cfg, usable)
    if valid(cfg.router) and valid(cfg.api_key):
        problems += router_exposes_nothing(cfg)
    if valid(cfg.network) and all(valid(node) for node in cfg.nodes):
        problems += router_reaches_replicas(cfg, usable) if valid(cfg.router) else []
        problems += prometheus_reaches_replicas(cfg, usable) if valid(cfg.metrics) else []
    return problems
