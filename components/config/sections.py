"""The sections of the stack config as pydantic models: a node, and each object key (`vllm`, `ray`,
`fabric`, …). Every model refuses unknown keys and is spelled in camelCase, as `pulumi config set
--path` takes it; field descriptions feed docs/config.md and Pulumi.yaml (scripts/config_reference.py)."""

from __future__ import annotations

import ipaddress
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic.alias_generators import to_camel

from components.config.types import (
    AbsolutePath,
    DnsLabel,
    ExtraArg,
    HostKeyLine,
    HostName,
    HttpEndpoint,
    ImageRef,
    LogSize,
    NetDevName,
    ParserName,
    Port,
    PositiveInt,
    PosixUser,
    RdmaDeviceName,
    ServedName,
)


class StrictModel(BaseModel):
    """Every model refuses unknown keys (a typo must not become a silent default) and is spelled
    in camelCase in the stack file, exactly as `pulumi config set --path` takes it."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=False,
        frozen=True,
        hide_input_in_errors=False,
    )


class NodeConfig(StrictModel):
    """`nodes[]`: one machine: how SSH reaches it (its management side) and its fabric link."""

    name: DnsLabel = Field(description="Node name: a DNS label, unique. Names resources and containers.")
    host: HostName = Field(description="SSH address of the node on the management network.")
    user: PosixUser = Field("root", description="SSH user; needs access to Docker (root or the docker group).")
    ssh_port: Port = Field(22, description="SSH port.")
    fabric_address: ipaddress.IPv4Address = Field(
        description="IPv4 address on the RoCE/InfiniBand fabric. Ray, NCCL, Gloo and vLLM use only this address."
    )
    fabric_interface: NetDevName = Field(
        description="Network interface carrying fabricAddress, e.g. enp1s0f1np1 (NCCL/Gloo/TP/UCX socket interface)."
    )
    rdma_devices: list[RdmaDeviceName] = Field(
        default_factory=list,
        description="RDMA devices for NCCL_IB_HCA, e.g. [rocep1s0f1, roceP2p1s0f1]. Empty: NCCL picks.",
    )
    gpus: PositiveInt = Field(1, description="GPUs this node gives to Ray (`ray start --num-gpus`).")
    host_key: Optional[HostKeyLine] = Field(
        None,
        description="The node's public SSH host key ('ssh-ed25519 AAAA…'), pinned on both SSH transports. "
        "Default: the key the node shows at the first `pulumi up`, then kept (trust on first use).",
    )


class SpeculativeConfig(StrictModel):
    """vllm.speculative: speculative decoding, rendered into vLLM 0.25's `--speculative-config`
    (vllm/config/speculative.py SpeculativeConfig)."""

    method: Literal["mtp", "ngram"] = Field(
        description="mtp: the model's own multi-token-prediction layers propose the tokens (Qwen3.5/3.6, Qwen3-Next, "
        "DeepSeek-V3, GLM-4.5…: config.json has mtp_num_hidden_layers or num_nextn_predict_layers; no other "
        "weights); ngram: tokens looked up in the prompt (any model, no weights, helps where answers repeat it)."
    )
    tokens: PositiveInt = Field(
        description="Tokens proposed a step (num_speculative_tokens). With mtp, more than the model's MTP layers "
        "must be a multiple of them (vLLM refuses the rest); each token is one more state block a sequence for a "
        "hybrid model (the memory plan counts it). Two-Spark recipes use 3 for Qwen3.5."
    )
    prompt_lookup_min: Optional[PositiveInt] = Field(
        None, description="ngram only: the shortest n-gram matched in the prompt (vLLM's default: 5)."
    )
    prompt_lookup_max: Optional[PositiveInt] = Field(
        None, description="ngram only: the longest n-gram matched in the prompt (vLLM's default: 5)."
    )


class VllmConfig(StrictModel):
    """`vllm`: what `vllm serve` is given beside the model and the parallelism, and how long the deploy waits."""

    host: ipaddress.IPv4Address = Field(
        ipaddress.IPv4Address("0.0.0.0"),
        description="Where the model's API is served on the head node. Without the router: the address the edge "
        "(the stack's endpoint) listens on, vLLM itself listening behind it on the head's fabric address (or on "
        "this address, when it is not 0.0.0.0). Behind the router: the address vLLM binds (`--host`), 0.0.0.0 "
        "meaning the head's fabric address: vLLM never listens on the management network.",
    )
    port: Port = Field(
        8000,
        description="Without the router: the endpoint's port, the edge's (vLLM itself takes edge.vllmPort). Behind "
        "the router: vLLM's own port (`--port`).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (`--gpu-memory-utilization`), in (0, 1]."
    )
    served_model_name: Optional[ServedName] = Field(
        None, description="Name clients use in requests (`--served-model-name`). Default: the model."
    )
    trust_remote_code: bool = Field(False, description="Run the model repository's own code (`--trust-remote-code`).")
    reasoning_parser: Optional[ParserName] = Field(None, description="`--reasoning-parser`, e.g. qwen3.")
    tool_call_parser: Optional[ParserName] = Field(None, description="`--tool-call-parser`, e.g. qwen3_coder.")
    enable_auto_tool_choice: bool = Field(False, description="`--enable-auto-tool-choice` (needs toolCallParser).")
    extra_args: list[ExtraArg] = Field(
        default_factory=list,
        description="Further `vllm serve` arguments, appended last, each one word (e.g. ['--max-num-seqs', '8']). "
        "Read as vLLM's parser reads them ('_' is '-', a unique prefix is the whole flag): a flag the program sets "
        "from a key, a secret (--api-key, --hf-token), --config, or a flag and its value in one element are refused.",
    )
    max_num_seqs: Union[Literal["auto"], PositiveInt] = Field(
        "auto",
        description="`--max-num-seqs`: sequences vLLM runs at once. auto: vLLM's default, except for a hybrid model "
        "(Qwen3.5, Qwen3-Next) whose cache holds fewer sequences than that default (1024 on a GPU of 70 GiB or "
        "more): then the memory plan sets what its cache blocks hold, as vLLM would otherwise refuse to start. "
        "A number is checked against those blocks before any container starts.",
    )
    ready_timeout_seconds: PositiveInt = Field(
        1800, description="How long `pulumi up` waits for /health and /v1/models after starting vLLM."
    )
    stall_seconds: int = Field(
        300,
        ge=30,
        description="Requests running and none of vLLM's progress counters (generated and prompt tokens, KV cache "
        "use, requests running and waiting: vLLM updates them at every engine step) moved this long, counted from the "
        "first read with requests on it (an idle pause does not count): the supervisor "
        "ends vLLM on every rank and starts it again, as a crash (docs/recovery.md). Above vLLM's longest single "
        "step: a chunked prefill moves the KV cache use at every chunk, and the last chunk of a long context on one "
        "Spark takes about 2 minutes at the most (docs/recovery.md says how that is reckoned). At least 30.",
    )
    canary_seconds: int = Field(
        300,
        ge=0,
        description="How often the supervisor asks an idle vLLM (nothing running or waiting) its canary: one short "
        "greedy completion, whose first tokens are compared with the answer this vLLM gave first. No answer within "
        "stallSeconds is a stall; other tokens, twice, are wrong numerics: vLLM is ended and started again. 0: off.",
    )
    allow_unauthenticated: bool = Field(
        False, description="Allow a non-loopback bind without apiKey. Anyone on the network can then use the model."
    )
    restart_generation: int = Field(
        0,
        ge=0,
        description="Bump to restart vLLM on the next `pulumi up` (also after the supervisor gave up on it).",
    )
    master_port: Port = Field(
        29501, description="executor mp: the port rank 0 listens on for the other nodes (`--master-port`)."
    )
    speculative: Optional[SpeculativeConfig] = Field(
        None,
        description="Speculative decoding (`--speculative-config`): a vLLM-only change, part of the release. With it "
        "on, validation compares greedy answers with the same model's without it, and the benchmark reports the "
        "acceptance and the speed-up over a start without it. Unset: off.",
    )


class RayConfig(StrictModel):
    """`ray`: the Ray cluster the Ray executor runs on: its ports, dashboard, auth and join wait."""

    port: Port = Field(6379, description="Ray GCS port on the head node.")
    join_timeout_seconds: PositiveInt = Field(
        300, description="How long to wait for every node and TP×PP GPUs to appear in Ray before starting vLLM."
    )
    dashboard: bool = Field(True, description="Run the Ray dashboard (bound to 127.0.0.1 on the head only).")
    auth: Literal["token", "none"] = Field(
        "token",
        description="Ray authentication: 'token' (RAY_AUTH_MODE=token, Ray ≥ 2.52) or 'none' for older images.",
    )
    # Ray's other listeners (raylet, object manager, agents, metrics) take random ports from the
    # kernel's ephemeral range, which the config's port rules and network.guard know as a whole.
    # They stay Ray's choice: pinned, a worker container re-created on a running cluster once failed to
    # rejoin vLLM's placement group in the rehearsal (its new raylet on the old one's address).
    dashboard_port: Port = Field(8265, description="Ray dashboard on the head, on 127.0.0.1 (`--dashboard-port`).")
    min_worker_port: Port = Field(10002, description="First port of the range Ray's worker processes listen on.")
    max_worker_port: Port = Field(19999, description="Last port of the range Ray's worker processes listen on.")
    metrics_export_port: Optional[Port] = Field(
        None,
        description="Ray's metrics on every node (`ray start --metrics-export-port`), scraped by the metrics "
        "config; needs the image's Ray with its dashboard agent (ray[default]). Unset: Ray's metrics are not scraped.",
    )


class NcclConfig(StrictModel):
    """`nccl`: NCCL's settings in every node container."""

    debug: Optional[Literal["VERSION", "WARN", "INFO", "TRACE"]] = Field(
        None, description="NCCL_DEBUG. INFO shows whether NCCL uses NET/IB (RDMA) or NET/Socket."
    )
    ib_disable: bool = Field(False, description="NCCL_IB_DISABLE=1: force TCP sockets (a workaround, slow).")


class NetworkConfig(StrictModel):
    """`network`: the fabric network the program keeps on each node, its MTU, and network.guard."""

    manage: bool = Field(False, description="Write and apply a netplan drop-in for the fabric interface.")
    prefix_length: int = Field(24, ge=1, le=32, description="Prefix length of fabricAddress.")
    mtu: Optional[int] = Field(None, ge=576, le=9216, description="MTU of the fabric interface (e.g. 9000).")
    guard: bool = Field(
        False,
        description="Let only the other nodes' fabric addresses reach Ray's ports, the ranks' ports (NCCL, Gloo: "
        "the ephemeral range), the mp master port and the copy depot: an nftables table (or iptables chain) "
        "of its own on each node. SSH and the vLLM port are never matched.",
    )
    api_sources: list[ipaddress.IPv4Network] = Field(
        default_factory=list,
        description="With guard: the networks (CIDR) that may reach vllm.port on the head. Empty: everyone.",
    )


class FabricConfig(StrictModel):
    """`fabric`: the fabric gate, each node's link checked before anything of the stack starts."""

    gate: Literal["enforce", "warn", "off"] = Field(
        "enforce",
        description="The fabric gate, on every node before any container: the fabric interface (up, carrier, MTU, "
        "speed), its RDMA devices (ACTIVE, RoCE v2 GID) against rdmaDevices, every peer reached over the fabric with "
        "a full-size packet, a short bandwidth test per pair. enforce stops the deploy on a problem, warn reports it.",
    )
    bandwidth_test: Literal["tcp", "nccl", "off"] = Field(
        "tcp",
        description="The bandwidth test between the nodes: tcp, a short TCP test per pair over the fabric addresses "
        "(on the hosts, before any image is pulled); nccl, an NCCL all-reduce across every node in the node's image "
        "with its GPUs and the Ray container's NCCL settings (once every node has the image; needs container.gpus), "
        "which also says whether NCCL uses RDMA or fell back to sockets.",
    )
    min_bandwidth_gbps: Optional[float] = Field(
        None,
        gt=0,
        description="Floor of the bandwidth test (Gb/s); below it is a problem. Default: with tcp 5 % of the slower "
        "link's speed (a coarse floor for one process's TCP streams: it catches a fabric that is not the fabric); "
        "with nccl 55 % of it for the all-reduce's bus bandwidth (110 Gb/s on a 200G link: both HCAs of a Spark "
        "give 150-190, one alone about half; NVIDIA's playbooks warn below 175).",
    )
    bandwidth_seconds: float = Field(1.0, ge=0.2, le=30, description="How long each pair's test sends.")
    peer_wait_seconds: float = Field(
        30,
        ge=1,
        le=600,
        description="How long each node's gate waits for its peers' gates to listen and measure (they start at about "
        "the same time); a peer that answers a ping but never runs its gate (its SSH refused) costs this long.",
    )
    min_link_speed_gbps: Optional[int] = Field(
        None,
        ge=1,
        description="Speed every fabric interface must run at (e.g. 200 on a DGX Spark). Default: only that the nodes "
        "agree.",
    )
    test_port: Port = Field(29660, description="TCP port of the bandwidth test on every node's fabric address.")


class LogsConfig(StrictModel):
    """`container.logs`: how much of its output each container the program starts keeps on its node (Docker's
    json-file driver, rotated): a node's disk is never filled by a log, whatever reaches it."""

    max_size: LogSize = Field("50m", description="The size at which a container's log is rotated (max-size).")
    max_files: int = Field(
        5, ge=1, le=100, description="Rotated files kept per container, the current one included (max-file)."
    )


class UlimitsConfig(StrictModel):
    """`container.ulimits`: the node containers' limits."""

    memlock: int = Field(
        -1, ge=-1, description="Locked-memory limit in bytes; -1 = unlimited (RDMA registers GPU memory)."
    )
    stack: int = Field(67108864, ge=-1, description="Stack size limit in bytes (64 MiB as NVIDIA's containers use).")
    nofile: int = Field(1048576, ge=1024, description="Open files (Ray's object store and NCCL sockets need many).")


class ContainerConfig(StrictModel):
    """`container`: the node containers (Ray's or vLLM-mp's): GPUs, mounts, restart and what they keep."""

    gpus: bool = Field(True, description="Give the containers every GPU (`--gpus all`). false for CPU-only hosts.")
    hf_cache_dir: Optional[AbsolutePath] = Field(
        None,
        description="Host directory mounted as the Hugging Face cache. Default: the Docker volume spark-vllm-hf-cache. "
        "With modelSync and a repo id: where the copy source downloads it once and the others receive it.",
    )
    hf_endpoint: Optional[HttpEndpoint] = Field(
        None, description="HF_ENDPOINT: a Hugging Face Hub mirror, for the modelSync download and vLLM alike."
    )
    privileged: bool = Field(
        False, description="Run the containers privileged. Off: only IPC_LOCK and /dev/infiniband when RDMA is used."
    )
    restart: Literal["no", "on-failure", "always", "unless-stopped"] = Field(
        "unless-stopped", description="Docker restart policy of the containers (brings them back after a reboot)."
    )
    keep_image: bool = Field(True, description="Keep the image on the nodes when the stack is destroyed.")
    compile_cache: bool = Field(
        True,
        description="Keep vLLM's torch.compile cache and FlashInfer's JIT cache (/root/.cache/vllm and "
        "/root/.cache/flashinfer in the container, about 100 MB) in the node's Docker volumes "
        "spark-vllm-compile-cache and spark-vllm-flashinfer-cache, so a re-created container (a changed container "
        "setting, a container removed by hand, the same vLLM re-pulled) starts from what the last one compiled "
        "(about 3x sooner on an H200: docs/measurements.md). Entries are keyed "
        "(vLLM: its version, the model and its settings; FlashInfer: its version and the GPU), so another vLLM or "
        "model compiles anew beside them. Kept when the stack is destroyed, like the Hugging Face cache.",
    )
    ulimits: UlimitsConfig = Field(
        default_factory=UlimitsConfig,
        description="Ulimits of the containers; lower them only where the host's hard limits cannot be raised.",
    )
    logs: LogsConfig = Field(
        default_factory=LogsConfig,
        description="Log rotation of every container the program starts (node containers, the edge, the router, "
        "the guard, the copy depot, Prometheus, Grafana): `docker logs` shows the newest; at most maxSize × "
        "maxFiles each on the node's disk.",
    )


class RecoveryConfig(StrictModel):
    """`recovery`: how the supervisor starts vLLM again after a crash, and when it stops trying."""

    max_restarts: PositiveInt = Field(
        5,
        description="vLLM exits within windowSeconds before each node's supervisor stops restarting it "
        "(the containers stay up; statusCommand says why).",
    )
    window_seconds: PositiveInt = Field(600, description="The window maxRestarts counts in.")
    backoff_seconds: PositiveInt = Field(
        2, description="Wait before restarting vLLM after it exited; doubles each time up to maxBackoffSeconds."
    )
    max_backoff_seconds: PositiveInt = Field(60, description="The longest wait between two restarts.")
    gpu_wait_seconds: PositiveInt = Field(
        180,
        description="Before a (re)start, how long the supervisor waits for the GPUs to have the memory vLLM asks "
        "for (gpuMemoryUtilization × total; the last processes of a crashed vLLM take a moment to free it); a start "
        "vLLM refuses for lack of GPU memory is not counted as a crash. Then it gives up, naming what holds the GPU.",
    )


class ImageTransferConfig(StrictModel):
    """`imageTransfer`: how the image reaches the nodes: pulled by each, or copied from the copy source."""

    method: Literal["pull", "copy"] = Field(
        "pull",
        description="'pull': every node pulls `image` from its registry. 'copy': the copy source (fabricCopy.source) "
        "has the image (built or loaded there, or pulled once) and the nodes lacking that image id receive it "
        "from there over the fabric.",
    )
    timeout_seconds: PositiveInt = Field(
        3600,
        description="How long one node may take to pull or receive the image (vLLM images for GB10 are 10–20 GB); "
        "it fails naming the node after that.",
    )
    progress_seconds: PositiveInt = Field(
        10, description="How often `pulumi up` shows each node's pull or copy progress (bytes, rate)."
    )


class ModelSyncConfig(StrictModel):
    """`modelSync`: the model directory copied from the copy source to every other node over the fabric."""

    enabled: bool = Field(
        False,
        description="Copy the model directory from the copy source (fabricCopy.source) to every node where it "
        "differs or is missing, over the fabric: only files whose size or time differ, symlinks kept, files the "
        "source lacks removed. Off: every node must hold the model already.",
    )
    timeout_seconds: PositiveInt = Field(14400, description="How long one node may take to receive the model.")
    progress_seconds: PositiveInt = Field(10, description="How often `pulumi up` shows each node's copy progress.")


class FabricCopyConfig(StrictModel):
    """`fabricCopy`: where the copies come from: the copy source's depot and its port."""

    source: Optional[DnsLabel] = Field(
        None,
        description="The node the others receive the image (imageTransfer.method copy) and the model (modelSync) "
        "from. Default: the head.",
    )
    port: Port = Field(29650, description="TCP port of the copy depot on the source's fabric address.")


class MemoryConfig(StrictModel):
    """`memory`: the memory plan (does the model fit each node) and the OOM guard."""

    os_reserve_gib: float = Field(
        8,
        gt=0,
        description="On unified memory (GB10): what gpuMemoryUtilization must leave the operating system, in GiB.",
    )
    drop_page_cache: bool = Field(
        False,
        description="Before vLLM starts, drop each node's page cache (`sync; echo 1 > /proc/sys/vm/drop_caches`) "
        "so cached files do not hold the memory vLLM counts on (root or passwordless sudo).",
    )
    oom_guard: bool = Field(
        False,
        description="Each node's supervisor ends vLLM when MemAvailable falls under osReserveGib, before the "
        "kernel's OOM killer picks a process (sshd, the supervisor) on a box whose GPU shares its memory; the "
        "restart then waits until the memory is back.",
    )


class SshConfig(StrictModel):
    """`ssh`: how the remote commands reach the nodes."""

    dial_error_limit: int = Field(
        20,
        ge=1,
        le=1000,
        description="Failed SSH dials each remote command retries before it fails (pulumi-command's "
        "dialErrorLimit; the wait between dials grows to 5 s): 20 is about a minute, through a reboot or a busy sshd. "
        "Lower it to fail fast on a node that is down.",
    )


class BenchmarkConfig(StrictModel):
    """`benchmark`: a short fixed load after the smoke test; its figures go to the outputs and the release."""

    enabled: bool = Field(
        False,
        description="After the smoke test, a short fixed load against the endpoint from the head; its figures "
        "become the `benchmark` output and part of the release (off in dev, on in staging and prod).",
    )
    tool: Literal["auto", "vllm", "spark-vllm"] = Field(
        "auto",
        description="`vllm`: the image's `vllm bench serve` (random dataset); `spark-vllm`: the project's own "
        "load script; `auto`: vllm when the image's `vllm bench serve --help` works.",
    )
    concurrency: int = Field(4, ge=1, le=1024, description="Requests in flight at once.")
    requests: int = Field(32, ge=1, le=100000, description="Requests in all.")
    prompt_tokens: int = Field(256, ge=1, description="Prompt length of every request, in tokens.")
    output_tokens: int = Field(128, ge=1, description="Tokens every request generates (ignore_eos).")
    max_errors: int = Field(0, ge=0, description="Failed requests allowed before the benchmark fails the deploy.")
    timeout_seconds: PositiveInt = Field(600, description="How long the whole benchmark may take.")


class ReleaseConfig(StrictModel):
    """`release`: the floors a promoted release's figures must meet."""

    min_output_tokens_per_second: Optional[float] = Field(
        None, gt=0, description="With promoteFrom: refuse a release whose benchmark made fewer output tokens/s."
    )
    max_p99_ttft_ms: Optional[float] = Field(
        None, gt=0, description="With promoteFrom: refuse a release whose benchmark's p99 time to first token was "
        "higher (ms).",
    )  # fmt: skip
    min_acceptance_length: Optional[float] = Field(
        None,
        ge=1,
        description="With promoteFrom: refuse a release with vllm.speculative whose benchmark accepted fewer tokens a "
        "step on average (1 + accepted drafts / drafts, from vLLM's spec_decode counters), or that has no such figure.",
    )
    min_speculative_speedup: Optional[float] = Field(
        None,
        gt=0,
        description="With promoteFrom: refuse a release with vllm.speculative whose benchmark made fewer output "
        "tokens/s than this multiple of the same load without speculation (e.g. 1.2), or that has no such figure.",
    )
    same_hosts: list[Literal["kernel", "os", "driver", "cuda", "gpus", "toolkit", "rdmaCore", "nicFirmware"]] = Field(
        default_factory=list,
        description="With promoteFrom: refuse the release where this stack's nodes differ from those it was "
        "validated on in these host facts (e.g. [driver, kernel, nicFirmware]); a difference in any other is a "
        "warning naming both.",
    )


class MetricsConfig(StrictModel):
    """`metrics`: the Prometheus targets, and the stack's own Prometheus and Grafana where a node is named."""

    prometheus_node: Optional[DnsLabel] = Field(
        None,
        description="A node that runs Prometheus (container spark-vllm.prometheus, data on the volume "
        "spark-vllm-prometheus) scraping every target of the `prometheusConfig` output.",
    )
    prometheus_image: ImageRef = Field("prom/prometheus:v3.5.0", description="Image of that Prometheus.")
    prometheus_port: Port = Field(9090, description="Port of that Prometheus's web UI and API.")
    scrape_interval_seconds: int = Field(15, ge=1, le=3600, description="How often every target is scraped.")
    retention_days: PositiveInt = Field(15, description="How long Prometheus keeps its samples.")
    node_port: Optional[Port] = Field(
        None,
        description="Each node's supervisor serves the node's memory (MemAvailable, the GPUs') and vLLM's restarts "
        "for Prometheus on this port of its fabric address (job spark-vllm-node: the dashboard's per-node "
        "panels). Unset: not served.",
    )
    grafana_node: Optional[DnsLabel] = Field(
        None,
        description="A node that runs Grafana (container spark-vllm.grafana, data on the volume spark-vllm-grafana) "
        "with the stack's Prometheus as its datasource and the `dashboard` output provisioned; needs "
        "prometheusNode and the grafanaAdminPassword secret.",
    )
    grafana_image: ImageRef = Field("grafana/grafana:12.0.2", description="Image of that Grafana.")
    grafana_port: Port = Field(3000, description="Port of that Grafana's web UI (GF_SERVER_HTTP_PORT).")


class EdgeConfig(StrictModel):
    """`edge`: HAProxy in front of the stack's endpoint (components/plan/edge.py), the one way in from the
    network: the key checked and the route on its allow-list before anything reaches vllm-router or vLLM."""

    image: ImageRef = Field(
        "haproxy:3.0",
        description="The HAProxy image (the official one, 2.6 or later; name it with @sha256:… to pin it). The edge's "
        "container runs the image id the node pulled. It needs bash and haproxy on its PATH, as the official "
        "Debian-based image has them.",
    )
    max_connections: int = Field(
        1024, ge=16, le=1000000, description="Client connections it holds at once; more wait in the kernel's queue."
    )
    per_source_connections: int = Field(
        256,
        ge=1,
        le=1000000,
        description="Connections one source address holds at once; more from it are closed at accept, so no one "
        "address takes every slot. At most maxConnections.",
    )
    keyless_per_source: int = Field(
        100,
        ge=1,
        le=1000000,
        description="Connections from one source address in any 10 s that carry no request with a key (/health, "
        "refused, bad or idle ones; one with a keyed request makes up for one), beyond which its new connections "
        "are closed at accept, unlogged, until its rate falls. A keyed client on kept-alive connections never "
        "meets it.",
    )
    head_timeout_seconds: int = Field(
        10, ge=1, le=3600, description="How long a client may take to send a request's head (slow heads dropped)."
    )
    body_timeout_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description="How long a keyed client may take to send the start of a request's body (the whole body, or "
        "its first 16 KiB: what the edge reads before passing the request on); 408 after it.",
    )
    idle_timeout_seconds: int = Field(
        60, ge=1, le=86400, description="How long a kept-alive client connection may sit idle between requests."
    )
    drain_seconds: int = Field(
        300,
        ge=1,
        le=86400,
        description="After a change of the edge's configuration (a key removed or replaced, a model added), how "
        "long a request already in flight may still run on the old configuration (HAProxy's hard-stop-after); "
        "new requests, and every connection once its answer is done, meet the new one at once.",
    )
    vllm_port: Port = Field(
        29002,
        description="Without the router: the port vLLM itself listens on behind the edge, on the head's fabric "
        "address (the endpoint keeps vllm.port).",
    )
    metrics_port: Port = Field(
        29003,
        description="The edge's own plain-HTTP port on its node's fabric address: /metrics (requests per client and "
        "model, for Prometheus) and the edge's health check. The endpoint's port never serves either.",
    )


class TlsConfig(StrictModel):
    """`tls` (a secret: `pulumi config set --secret --path tls.key < key.pem`): the certificate the edge serves the
    endpoint with (components/config/tls.py checks it before anything starts)."""

    certificate: str = Field(
        description="PEM: the server's certificate first, then any intermediate ones. Its names (subjectAltName) "
        "must cover the host the endpoint is reached at (the edge node's `host`).",
    )
    key: SecretStr = Field(description="PEM: the certificate's private key, unencrypted (RSA, ECDSA or Ed25519).")
    ca: str = Field(
        description="PEM: the CA certificate that signed it (the certificate itself when it is self-signed): the "
        "program's own steps verify the endpoint with it, as clients do.",
    )


class SecurityConfig(StrictModel):
    """`security`: security switches."""

    require_host_keys: bool = Field(False, description="Refuse nodes without hostKey instead of warning.")
