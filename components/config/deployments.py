"""Several models on one cluster: `deployments` (each a model on some of the nodes, with its own
parallelism, executor, `vllm` and `ray` settings and replicas) and the `router` in front of them.

A stack without `deployments` serves one model from the top-level keys, as it always did (its resources keep
their names). With `deployments`, those single-model keys move into each deployment; the rules that hold
for one model hold for each (components/config/placement.py), and the nodes two deployments share must
hold both."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from components.config.sections import RayConfig, VllmConfig, _Model
from components.config.types import DnsLabel, ModelRef, Port, PositiveInt, _pattern

# The vllm-router release the router runs (PyPI `vllm-router`, vllm-project/router): its HTTP API (IGW mode,
# /workers) is what components/scripts/router_keeper.py speaks, checked against this version.
ROUTER_VERSION = "0.1.17"
RouterVersion = Annotated[str, _pattern(r"[0-9]+\.[0-9]+\.[0-9]+", "a vllm-router version such as 0.1.17")]

# The top-level keys that describe one model: with `deployments` each deployment has its own.
SINGLE_MODEL_KEYS = (
    ("model", "model"),
    ("tensorParallelSize", "tensor_parallel_size"),
    ("pipelineParallelSize", "pipeline_parallel_size"),
    ("maxModelLen", "max_model_len"),
    ("executor", "executor"),
    ("head", "head"),
    ("vllm", "vllm"),
    ("ray", "ray"),
)


class DeploymentConfig(_Model):
    name: DnsLabel = Field(
        description="Deployment name: a DNS label, unique. Names its resources and containers "
        "(spark-vllm-<name>-<node>); replica k > 1 is <name>-<k>. Replicas that share their one node listen on "
        "vllm.port + k - 1 (and vllm.masterPort + k - 1)."
    )
    model: Optional[ModelRef] = Field(
        None, description="Model path or Hugging Face repo id, as the top-level `model` (with promoteFrom: none)."
    )
    nodes: list[DnsLabel] = Field(
        min_length=1,
        description="The nodes it runs on (names from `nodes`), in order; the first of each replica's is its head "
        "(rank 0, the API server). With replicas: N the list splits in N groups of equal size, one a replica; "
        "one node for several replicas runs them all there.",
    )
    tensor_parallel_size: PositiveInt = Field(1, description="`--tensor-parallel-size` of each replica.")
    pipeline_parallel_size: PositiveInt = Field(
        1, description="`--pipeline-parallel-size` of each replica. TP × PP = the GPUs of a replica's nodes."
    )
    max_model_len: Optional[PositiveInt] = Field(None, description="`--max-model-len`.")
    executor: Literal["auto", "ray", "mp"] = Field(
        "auto", description="As the top-level `executor`: how a replica spans its nodes ('auto': by the image)."
    )
    replicas: PositiveInt = Field(
        1,
        description="Copies of it behind the router, which balances across them. A change is applied to one "
        "replica at a time: out of the router, changed, ready and smoke-tested, back in; then the next.",
    )
    vllm: VllmConfig = Field(
        default_factory=VllmConfig,
        description="Its `vllm serve` settings (port, gpuMemoryUtilization, servedModelName, parsers, "
        "extraArgs…), as the top-level `vllm`. Deployments sharing a node need their own ports there.",
    )
    ray: RayConfig = Field(
        default_factory=RayConfig,
        description="Its Ray cluster's settings with executor ray, as the top-level `ray`: two Ray heads on one "
        "node need their own port, dashboardPort and worker port range.",
    )


class RouterConfig(_Model):
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
            _pattern(
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
