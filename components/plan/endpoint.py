"""Where the stack's endpoint is and where vLLM listens behind it. Pure (no Pulumi).

Nothing from the network reaches vLLM or vllm-router before the edge (components/plan/edge.py) checked the key
and the route. Two shapes, one rule:

* without the router (one model): the edge listens where the endpoint always was, vllm.host:vllm.port on the
  head, and vLLM itself on the head's fabric address at edge.vllmPort;
* with the router: the edge listens on router.port of router.node in front of vllm-router (loopback,
  router.innerPort), and each replica's vLLM on its head's fabric address at its vllm.port, where the router
  (and Prometheus) reach it over the fabric and network.guard lets only the nodes' fabric addresses in.

vLLM binds the fabric address rather than every address because its own `--api-key` guards only the paths
under /v1, /v2 and /inference (vllm/entrypoints/serve/utils/server_utils.py GUARDED_PREFIX): /invocations,
/tokenize, /pooling, /score and the rest answer anyone who reaches the port."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from components.config import ClusterConfig, NodeConfig
from components.config.models import PROGRAM_CLIENT
from components.plan.edge import EdgeSpec, Timeouts, key_digest


def vllm_host(cfg: ClusterConfig) -> str:
    """The address vLLM binds on its head (`--host`): vllm.host when it names one, else the fabric address."""
    host = cfg.vllm.host
    return str(cfg.head_node.fabric_address) if host.is_unspecified else str(host)


def vllm_port(cfg: ClusterConfig) -> int:
    """vLLM's own port (`--port`): vllm.port behind the router; edge.vllmPort where the edge takes vllm.port."""
    return cfg.vllm.port if cfg.router.enabled else cfg.edge.vllm_port


def vllm_url(cfg: ClusterConfig) -> str:
    """vLLM's API server, as its head, the router and Prometheus reach it."""
    return f"http://{vllm_host(cfg)}:{vllm_port(cfg)}"


def edge_node(cfg: ClusterConfig) -> NodeConfig:
    """Where the edge runs: the router's node, or the head (a valid config names both)."""
    node = cfg.endpoint_node
    assert node is not None, "a valid config names the router's node and the head"
    return node


def edge_listen(cfg: ClusterConfig) -> tuple[str, int]:
    """(address, port) the edge listens on: the endpoint's."""
    if cfg.router.enabled:
        node = edge_node(cfg)
        return ("0.0.0.0" if cfg.router.host == "0.0.0.0" else str(node.fabric_address)), cfg.router.port
    return str(cfg.vllm.host), cfg.vllm.port


def endpoint(cfg: ClusterConfig) -> str:
    """The stack's OpenAI-compatible endpoint, as clients on the management network reach it: https:// with `tls`."""
    scheme = "https" if cfg.tls is not None else "http"
    return f"{scheme}://{edge_node(cfg).host}:{edge_listen(cfg)[1]}/v1"


def tls_pem(cfg: ClusterConfig) -> Optional[str]:
    """What the edge serves HTTPS with (secret): the certificate chain, then its key."""
    if cfg.tls is None:
        return None
    chain, key = cfg.tls.certificate.strip(), cfg.tls.key.get_secret_value().strip()
    return f"{chain}\n{key}\n"


def declared_models(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The models the edge lists at /v1/models, from the router's declared workers (a drained or down one's
    too): one entry a served name, the first replica's root and max_model_len, sorted by name."""
    found: dict[str, dict[str, Any]] = {}
    for worker in workers:
        found.setdefault(
            worker["model"], {"id": worker["model"], "root": worker["root"], "max_model_len": worker["max_model_len"]}
        )
    return [found[name] for name in sorted(found)]


def edge_spec(
    cfg: ClusterConfig,
    program_key: Optional[str],
    served: Sequence[str],
    models: Optional[list[dict[str, Any]]] = None,
) -> EdgeSpec:
    """The edge's configuration: in front of vllm-router (which answers no OpenAI model list: `models`, the
    declared models' cards) or of vLLM itself (which does). Its clients: every key of cfg.client_keys by name, and
    the program's own (`program_key`, which it also sends upstream: vLLM's key); `served`: the models' names."""
    host, port = edge_listen(cfg)
    if cfg.router.enabled:
        upstream: tuple[str, int] = ("127.0.0.1", cfg.router.inner_port)
    else:
        upstream = (vllm_host(cfg), vllm_port(cfg))
    keys = cfg.client_keys
    clients = [(name, key_digest(key)) for name, key in keys.items()]
    if keys and program_key:
        clients.append((PROGRAM_CLIENT, key_digest(program_key)))
    edge = cfg.edge
    return EdgeSpec(
        host=host,
        port=port,
        upstream_host=upstream[0],
        upstream_port=upstream[1],
        metrics_host=str(edge_node(cfg).fabric_address),
        metrics_port=edge.metrics_port,
        clients=tuple(clients),
        upstream_key=program_key,
        models=models if cfg.router.enabled else None,
        model_names=tuple(sorted(set(served))),
        tls_pem=tls_pem(cfg),
        max_connections=edge.max_connections,
        per_source_connections=edge.per_source_connections,
        keyless_per_source=edge.keyless_per_source,
        timeouts=Timeouts(
            head=edge.head_timeout_seconds,
            body=edge.body_timeout_seconds,
            idle=edge.idle_timeout_seconds,
            drain=edge.drain_seconds,
        ),
    )
