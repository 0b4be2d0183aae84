# What the program hands a node's container, typed once for both sides: components/render.py builds these
# (it imports this file as a module) and the scripts in the container read them (it is prepended to
# the scripts that read them by components.render.SCRIPT_HELPERS). The JSON is
# the dataclasses' fields, so a field added here is a field both sides know. Standard library only (Python
# 3.7+, whatever the image has), no side effects.
import dataclasses
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SupervisorParams:
    """What the container is (its command: a change replaces the container, so only what must)."""

    node: str
    executor: str  # "ray" or "mp"
    run_dir: str
    ray_argv: Optional[list]  # `ray start …` for this node with Ray; None with mp
    stop_grace_seconds: float
    guard_marker: Optional[str] = None  # with network.guard: the marker its container writes once its rules hold
    metrics_port: Optional[int] = None  # metrics.nodePort: the node's metrics on its fabric address

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for optional in ("guard_marker", "metrics_port"):
            if data[optional] is None:
                del data[optional]  # only when set: turning nothing on changes no container
        return data


@dataclass(frozen=True)
class Recovery:
    """The stack's `recovery` keys (their defaults are the config's: components/config/sections.py)."""

    max_restarts: int
    window_seconds: float
    backoff_seconds: float
    max_backoff_seconds: float
    gpu_wait_seconds: float


@dataclass(frozen=True)
class RayReady:
    """The Ray head's wait before vLLM: every node alive and the GPUs TP × PP needs."""

    address: str
    nodes: int
    gpus: int


@dataclass(frozen=True)
class VllmSpec:
    """RUN_DIR/spec.json: what vLLM is on this node, handed over by the serve step (serve_spec.py)."""

    argv: list
    env: dict  # the API key among them: the file is mode 600
    fingerprint: str
    recovery: Recovery
    gpu_memory_utilization: Optional[float]  # what vLLM asks of each GPU at start; None without GPUs
    health_url: Optional[str]  # on the API server's node
    ray_ready: Optional[RayReady]  # on the Ray head
    oom_guard_mib: Optional[float] = None  # memory.oomGuard: vLLM is ended when MemAvailable falls under this
    tenancy: Optional["Tenancy"] = None  # with deployments: who this is on the node, and who else is there

    @classmethod
    def from_json(cls, data: dict) -> "VllmSpec":
        ray_ready = data.get("ray_ready")
        tenancy = data.get("tenancy")
        return cls(
            argv=list(data["argv"]),
            env=dict(data.get("env") or {}),
            fingerprint=data["fingerprint"],
            recovery=Recovery(**data["recovery"]),
            gpu_memory_utilization=data.get("gpu_memory_utilization"),
            health_url=data.get("health_url"),
            ray_ready=RayReady(**ray_ready) if ray_ready else None,
            oom_guard_mib=data.get("oom_guard_mib"),
            tenancy=Tenancy.from_json(tenancy) if tenancy else None,
        )


@dataclass(frozen=True)
class Tenancy:
    """A replica on a node it shares with other replicas: its name (what its neighbours are told) and how long it
    may hold the node's GPU turn (node_gpu_turn.py). Who the neighbours are is asked on the node itself, so a
    replica added beside it changes nothing here."""

    replica: str
    turn_hold_seconds: float  # vllm.readyTimeoutSeconds: a start that takes longer gives the turn back

    @classmethod
    def from_json(cls, data: dict) -> "Tenancy":
        return cls(**data)


def spec_fields(
    recovery: Recovery, gpu_memory_utilization, health_url, ray_ready, oom_guard_mib=None, tenancy=None
) -> dict:
    """The part of a VllmSpec the serve step renders beside argv, env and fingerprint, as JSON."""
    fields = {
        "recovery": dataclasses.asdict(recovery),
        "gpu_memory_utilization": gpu_memory_utilization,
        "health_url": health_url,
        "ray_ready": dataclasses.asdict(ray_ready) if ray_ready is not None else None,
    }
    if oom_guard_mib is not None:  # only with the guard: turning nothing on restarts no vLLM
        fields["oom_guard_mib"] = oom_guard_mib
    if tenancy is not None:  # only with deployments: a single-model stack's spec (and its vLLM) stays as it was
        fields["tenancy"] = dataclasses.asdict(tenancy)
    return fields


@dataclass(frozen=True)
class HandoverParams:
    """serve_spec.py on a node: vLLM's settings for its supervisor (the API key in env: a secret)."""

    node: str
    argv: list
    env: dict
    spec: dict  # VllmSpec's other fields (spec_fields)
    fingerprint: str
    run_dir: str
    timeout_seconds: float
    ray_non_carry_over: list = field(default_factory=list)  # with Ray: env vars a worker must not inherit


@dataclass(frozen=True)
class ReadyParams:
    """wait_ready.py on the API node: /health 200 and /v1/models listing `model`."""

    base_url: str
    model: str
    timeout_seconds: float
    poll_seconds: float
    progress_seconds: float
    log_file: str
    status_file: str
    api_key: Optional[str] = None
    silent_seconds: float = 60  # log silence after which the progress names vLLM's long step


@dataclass(frozen=True)
class SmokeParams:
    """smoke.py on the API node: one short chat completion."""

    base_url: str
    model: str
    prompt: str
    max_tokens: int
    timeout_seconds: float
    api_key: Optional[str] = None


@dataclass(frozen=True)
class AnswersParams:
    """node_answers.py on the API node: greedy answers to a fixed set of conversations (each a list of
    user turns, later turns sent with the earlier turns and answers: a cached prefix), and, with
    `baseline`, whether they agree with those answers (the same model and engine without speculation)."""

    base_url: str
    model: str
    conversations: list  # [{"id": str, "turns": [str, ...]}]
    max_tokens: int
    timeout_seconds: float
    api_key: Optional[str] = None
    baseline: Optional[list] = None  # [{"id", "tokenIds", "text"}] as an earlier run printed them


@dataclass(frozen=True)
class ClusterWaitParams:
    """ray_join.py on the Ray head: every node alive in Ray and the GPUs TP × PP needs."""

    node: str
    ray_address: str
    expected: list  # [{"name", "fabric_address"}]
    gpus_needed: int
    timeout_seconds: float
    poll_seconds: float
    progress_seconds: float


@dataclass(frozen=True)
class BenchmarkParams:
    """node_benchmark.py on the API node: the configured load against the served model."""

    base_url: str
    model: str
    model_path: str  # what vLLM loaded: the tokenizer `vllm bench serve` needs
    tool: str
    concurrency: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    max_errors: int
    timeout_seconds: float
    api_key: Optional[str] = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class NcclParams:
    """nccl_bandwidth.py in `docker run` on a node: its rank of the fabric gate's all-reduce."""

    node: str
    rank: int
    world: int
    master_address: str
    port: int
    megabytes: int
    warmup: int
    iterations: int
    timeout_seconds: float


@dataclass(frozen=True)
class FabricGateParams:
    """node_fabric_gate.py on a node's host: the fabric's facts, the peers, the TCP test."""

    node: str
    interface: str
    address: str
    peers: list  # [{"name", "address"}]
    rdma_root: str
    bandwidth: Optional[dict] = None  # {"port", "seconds", "streams", "targets", "expect", "wait_seconds"}


@dataclass(frozen=True)
class HfDownloadParams:
    """hf_download.py on the copy source: a Hugging Face repo id into the host's cache directory."""

    node: str
    repo: str
    hf_home: str
    host_cache: str
    progress_seconds: float
    endpoint: Optional[str] = None
    token: Optional[str] = None


def params_of(cls, **fields) -> dict:
    """What render.py hands a script: `cls`'s fields as JSON-ready data (a field unknown or missing: TypeError)."""
    return dataclasses.asdict(cls(**fields))
