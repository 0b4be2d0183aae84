"""Several models on one cluster: `deployments` (each a model on some of the nodes, with its own
parallelism, executor, `vllm` and `ray` settings and replicas) and the `router` in front of them.

A stack without `deployments` serves one model from the top-level keys, as it always did (its resources keep
their names). With `deployments`, those single-model keys move into each deployment; the rules that hold
for one model hold for each (components/config/replicas.py), and the nodes two deployments share must
hold both."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field
from pydantic.alias_generators import to_camel

from components.config.sections import RayConfig, StrictModel, VllmConfig
from components.config.types import DnsLabel, ModelRef, Port, PositiveInt, matching

# The vllm-router release the router runs (PyPI `vllm-router`, vllm-project/router): its HTTP API (IGW mode,
# /workers) is what components/scripts/router_keeper.py speaks, checked against this version.
ROUTER_VERSION = "0.1.17"
RouterVersion = Annotated[str, matching(r"[0-9]+\.[0-9]+\.[0-9]+", "a vllm-router version such as 0.1.17")]


class ModelSettings(StrictModel):
    """What one model is served with: a single-model stack's top-level keys, or each deployment's (which then
    replace them)."""

    model: Optional[ModelRef] = Field(
        None,
        description="Model path (mounted read-only at the same path on every node; normalised, not a system or home "
        "directory) or Hugging Face repo id. With promoteFrom: none (the release names it).",
    )
    tensor_parallel_size: PositiveInt = Field(1, description="`--tensor-parallel-size` (of each replica).")
    pipeline_parallel_size: PositiveInt = Field(
        1, description="`--pipeline-parallel-size`. TP × PP = the GPUs of the nodes (of a replica's)."
    )
    max_model_len: Optional[PositiveInt] = Field(None, description="`--max-model-len`.")
    executor: Literal["auto", "ray", "mp"] = Field(
        "auto",
        description="How vLLM spans the nodes: 'ray' (Ray head and workers, `vllm serve` on the head) or 'mp' "
        "(vLLM's own multi-node executor: `vllm serve` on every node, `--headless` on the workers). 'auto' picks "
        "by the image: mp for the stock vllm/vllm-openai image (no Ray in it since v0.19), ray for other images "
        "(Spark builds carry Ray); a deployment whose replicas have one node each takes mp. The image check on "
        "every node confirms it before any container starts.",
    )
    vllm: VllmConfig = Field(
        default_factory=VllmConfig,
        description="`vllm serve` settings (port, gpuMemoryUtilization, servedModelName, parsers, extraArgs…). "
        "Deployments sharing a node need their own ports there.",
    )
    ray: RayConfig = Field(
        default_factory=RayConfig,
        description="Ray cluster settings (executor ray): two Ray heads on one node need their own port, "
        "dashboardPort and worker port range.",
    )


# The top-level keys that describe one model: with `deployments` each deployment has its own (`head`: its nodes).
SINGLE_MODEL_KEYS = (*((to_camel(name), name) for name in ModelSettings.model_fields), ("head", "head"))


class _Placed(StrictModel):
    """A deployment's name and nodes: its first keys (pydantic lists a class's fields after its bases', the
    last base's first)."""

    name: DnsLabel = Field(
        description="Deployment name: a DNS label, unique. Names its resources and containers "
        "(spark-vllm-<name>-<node>); replica k > 1 is <name>-<k>. Replicas that share their one node listen on "
        "vllm.port + k - 1 (and vllm.masterPort + k - 1)."
    )
    nodes: list[DnsLabel] = Field(
        min_length=1,
        description="The nodes it runs on (names from `nodes`), in order; the first of each replica's is its head "
        "(rank 0, the API server). With replicas: N the list splits in N groups of equal size, one a replica; "
        "one node for several replicas runs them all there.",
    )


class DeploymentConfig(ModelSettings, _Placed):
    """One model on some of the nodes, with replicas behind the router."""

    replicas: PositiveInt = Field(
        1,
        description="Copies of it behind the router, which balances across them. A change is applied to one "
        "replica at a time: out of the router, changed, ready and smoke-tested, back in; then the next.",
    )


class RouterConfig(StrictModel):
    """`router`: vllm-router in front of the deployments, one OpenAI-compatible endpoint for them all."""

    enabled: Optional[bool] = Field(
        None,
        description="Run the router (vllm-router) in front of the deployments: one OpenAI-compatible endpoint "
        "that routes by the request's `model` and balances across replicas. Default: on with several deployments "
        "or replicas, off with one.",
    )
    node: Optional[DnsLabel] = Field(
        None, description="The node running it (container spark-vllm.router). Default: the first deployment's head."
    )
    host: Literal["0.0.0.0", "fabric"] = Field(
        "0.0.0.0", description="Where it listens: every address (0.0.0.0), or the node's fabric address only."
    )
    port: Port = Field(8080, description="Its HTTP port: the stack's `endpoint`.")
    metrics_port: Port = Field(
        29000, description="Its Prometheus metrics (vllm-router --prometheus-port), on the node's fabric address."
    )
    inner_port: Port = Field(
        29001,
        description="Where vllm-router itself listens, on the node's loopback only: router.port is the keeper's front, "
        "which answers /v1/models in OpenAI's shape, keeps vllm-router's admin API off the network and passes the "
        "rest on.",
    )
    policy: Literal["round_robin", "cache_aware", "random"] = Field(
        "round_robin",
        description="How it picks among a model's replicas (vllm-router --policy): round_robin takes turns; "
        "cache_aware (vllm-router's own default) follows the prompt's prefix to the replica that has it cached, "
        "and sent every request of a sequential load to one replica here.",
    )
    version: RouterVersion = Field(
        ROUTER_VERSION,
        description="The vllm-router release (PyPI). The image's own when it has this version; else installed at "
        "the router's first start into the volume spark-vllm-router (the node needs PyPI, or routerIndexUrl).",
    )
    index_url: Optional[
        Annotated[
            str,
            matching(
                r"https?://[A-Za-z0-9.:/_%+~-]+",
                "an http(s) URL without credentials (no user:token@: they would sit in plain text in the stack "
                "file and in the router container's command; use a mirror that needs none, or an image with "
                "vllm-router in it)",
            ),
        ]
    ] = Field(None, description="A PyPI mirror for that install (pip --index-url). Default: PyPI.")
    health_check_interval_seconds: PositiveInt = Field(
        5, description="How often the router checks each replica's /health (--health-check-interval-secs)."
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve the router without apiKey. It listens beyond loopback (every address, or the fabric "
        "address), so anyone who reaches its port can then use every model behind it.",
    )


def replica_name(deployment: str, index: int) -> str:
    """Replica `index` of a deployment: the first one takes the deployment's name, then `name-2`, `name-3`, …"""
    return deployment if index == 0 else f"{deployment}-{index + 1}"


def node_groups(node_names: list[str], replicas: int) -> list[list[str]]:
    """The nodes of each replica: one node for all of them, or the list split in `replicas` equal groups."""
    if len(node_names) == 1:
        return [list(node_names)] * replicas
    size = len(node_names) // replicas
    return [node_names[k * size : (k + 1) * size] for k in range(replicas)]
