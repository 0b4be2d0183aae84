"""The stack config of spark-vllm as pydantic models, and every rule it must satisfy.

No I/O happens here: the models are filled from a plain dict (``load_cluster_config``), so the
same rules run under `pulumi up`, under Pulumi's mocks and in pure unit tests. Field descriptions
feed the config reference in docs/config.md (``tests/unit/test_readme.py`` keeps the two in step).
"""

from __future__ import annotations

import difflib
import ipaddress
import posixpath
import re
import shlex
import typing
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from components.ssh_keys import host_key_problem, private_key_problem
from components.vllm_args import read_extra_args

NAMESPACE = "spark-vllm"


def _pattern(regex: str, expected: str):
    """A validator for strings that end up in shell commands: the allowed alphabet is tight so a
    value can never be read as shell syntax, and quoting at the edge is a second line of defence."""
    compiled = re.compile(regex)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"expected {expected}")
        return value

    return AfterValidator(check)


DnsLabel = Annotated[
    str,
    _pattern(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", "a DNS label (a-z, 0-9, '-', at most 63 characters)"),
]
HostName = Annotated[
    str,
    _pattern(
        r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?",
        "a host name or IPv4 address (letters, digits, '.', '-')",
    ),
]
PosixUser = Annotated[str, _pattern(r"[a-z_][a-z0-9_-]{0,31}", "a user name (a-z, 0-9, '_', '-')")]
NetDevName = Annotated[
    str,
    _pattern(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}", "a network interface name (at most 15 of A-Z a-z 0-9 _ . -)"),
]
RdmaDeviceName = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", "an RDMA device name such as rocep1s0f1")]
ImageRef = Annotated[
    str,
    _pattern(
        r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
        r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?",
        "an image reference: name[:tag][@sha256:<64 hex>]",
    ),
]
# Directories no path of the stack may be: the model is mounted into every container and, with
# modelSync, mirrored onto every other node (files the source lacks are deleted there).
SYSTEM_DIRS = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/lost+found", "/media",
     "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/usr/local", "/var",
     "/var/lib", "/var/lib/docker"}
)  # fmt: skip
SYSTEM_TREES = ("/bin/", "/boot/", "/dev/", "/etc/", "/lib/", "/lib32/", "/lib64/", "/proc/", "/run/", "/sbin/",
                "/sys/", "/usr/bin/", "/usr/lib/", "/usr/sbin/", "/var/lib/docker/", "/var/run/")  # fmt: skip


def _normal_path(value: str) -> str:
    """An absolute path as it is meant: no `.` or `..` segment, no `//`, no trailing `/`, not a system directory."""
    if not value.startswith("/"):
        return value
    normal = posixpath.normpath(value)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if normal != value:
        raise ValueError(
            f"a normalised path: write it as {normal!r} (no '.' or '..' segment, no '//', no trailing '/'; "
            "the model is mounted and, with modelSync, mirrored at exactly this path)"
        )
    if value in SYSTEM_DIRS or value.startswith(SYSTEM_TREES) or re.fullmatch(r"/home/[^/]+", value):
        raise ValueError(
            "a directory of its own (such as /models/Name), not a system or home directory: it is mounted into "
            "every container, and modelSync deletes on the other nodes what the source lacks there"
        )
    return value


def _repo_id(value: str) -> str:
    """A Hugging Face repo id as the Hub takes it (huggingface_hub utils/_validators.py validate_repo_id)."""
    if value.startswith("/"):
        return value
    if "--" in value or ".." in value:
        raise ValueError("a Hugging Face repo id without '--' or '..' (the Hub refuses both)")
    if value.endswith(".git") or value.endswith((".", "-")) or len(value.split("/")[1]) > 96:
        raise ValueError("a Hugging Face repo id (a name of at most 96 characters, not ending in '.', '-' or '.git')")
    return value


ModelRef = Annotated[
    str,
    _pattern(
        r"/+[A-Za-z0-9._+@=-]+(/+[A-Za-z0-9._+@=-]+)*/*|[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*",
        "an absolute path (/models/Name) or a Hugging Face repo id (org/name)",
    ),
    AfterValidator(_normal_path),
    AfterValidator(_repo_id),
]
HttpEndpoint = Annotated[
    str,
    _pattern(
        r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?", "an http(s) URL such as https://hf-mirror.com"
    ),
]
AbsolutePath = Annotated[
    str,
    _pattern(r"/+[A-Za-z0-9._+@=-]+(/+[A-Za-z0-9._+@=-]+)*/*", "an absolute path of A-Z a-z 0-9 . _ + @ = -"),
    AfterValidator(_normal_path),
]
ServedName = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9._/:+-]{0,127}", "a model name of A-Z a-z 0-9 . _ / : + -")]
ParserName = Annotated[str, _pattern(r"[a-z0-9][a-z0-9_-]{0,63}", "a parser name such as qwen3 (a-z, 0-9, _, -)")]
StackName = Annotated[
    str,
    _pattern(
        r"(?!\.{1,2}(/|$))[A-Za-z0-9_.-]+(/(?!\.{1,2}(/|$))[A-Za-z0-9_.-]+){0,2}",
        "a stack name, fully qualified as organization/project/stack (no '.' or '..' part)",
    ),
]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]
_HOST_KEY = re.compile(
    r"(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521) [A-Za-z0-9+/]+={0,3}"
)


def _host_key(value: str) -> str:
    if not _HOST_KEY.fullmatch(value):
        raise ValueError(
            "expected a public host key line such as 'ssh-ed25519 AAAA…' (see `ssh-keyscan -t ed25519 HOST`)"
        )
    if value.startswith("ssh-rsa "):
        # pulumi-command offers only the pinned key's type, and for ssh-rsa that is SHA-1 RSA,
        # which OpenSSH 8.8 and later refuse: every remote command would fail to connect.
        raise ValueError(
            "an ed25519 (or ecdsa) key: an ssh-rsa host key makes the remote commands offer SHA-1 RSA, which "
            "OpenSSH 8.8 and later refuse (get the ed25519 one: `ssh-keyscan -t ed25519 HOST`)"
        )
    problem = host_key_problem(value)
    if problem is not None:
        raise ValueError(
            f"a public host key line whose key is whole: {problem} (copy it again from "
            "`ssh-keyscan -t ed25519 HOST`, the part after the host name)"
        )
    return value


HostKeyLine = Annotated[str, AfterValidator(_host_key)]


_EMPTY_MEANS = {
    "apiKey": "no key reaches vLLM, which then serves every caller",
    "hfToken": "the Hub is asked without a token: a gated model fails to download",
}


def _token_secret(value: SecretStr, info: ValidationInfo) -> SecretStr:
    """An API key or token: set means something, sent as one HTTP header word."""
    key = to_camel(info.field_name or "apiKey")
    text = value.get_secret_value()
    if not text.strip():
        raise ValueError(
            f"a value: it is set but empty, which counts as none ({_EMPTY_MEANS.get(key, 'nothing is sent')}); "
            f"set one (`pulumi config set --secret {key} …`) or remove it (`pulumi config rm {key}`)"
        )
    if any(ch.isspace() or ord(ch) < 33 or ord(ch) == 127 for ch in text):
        raise ValueError(
            "a key without spaces, line breaks or control characters (a newline copied with it?): clients send it "
            "as one word in the Authorization header"
        )
    return value


def _private_key_secret(value: SecretStr) -> SecretStr:
    problem = private_key_problem(value.get_secret_value())
    if problem is not None:
        raise ValueError(problem)
    return value


TokenSecret = Annotated[SecretStr, AfterValidator(_token_secret)]
PrivateKeySecret = Annotated[SecretStr, AfterValidator(_private_key_secret)]


def _extra_arg(value: str) -> str:
    if not value or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError("expected a non-empty argument without control characters or newlines")
    return value


ExtraArg = Annotated[str, AfterValidator(_extra_arg)]


class _Model(BaseModel):
    """Every model refuses unknown keys (a typo must not become a silent default) and is spelled
    in camelCase in the stack file, exactly as `pulumi config set --path` takes it."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=False,
        frozen=True,
        hide_input_in_errors=False,
    )


class NodeConfig(_Model):
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


class VllmConfig(_Model):
    host: ipaddress.IPv4Address = Field(
        ipaddress.IPv4Address("0.0.0.0"), description="Address vLLM binds on the head node (`--host`)."
    )
    port: Port = Field(8000, description="HTTP port of the OpenAI-compatible server (`--port`).")
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


class RayConfig(_Model):
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


class NcclConfig(_Model):
    debug: Optional[Literal["VERSION", "WARN", "INFO", "TRACE"]] = Field(
        None, description="NCCL_DEBUG. INFO shows whether NCCL uses NET/IB (RDMA) or NET/Socket."
    )
    ib_disable: bool = Field(False, description="NCCL_IB_DISABLE=1: force TCP sockets (a workaround, slow).")


class NetworkConfig(_Model):
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


class FabricConfig(_Model):
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


class UlimitsConfig(_Model):
    memlock: int = Field(
        -1, ge=-1, description="Locked-memory limit in bytes; -1 = unlimited (RDMA registers GPU memory)."
    )
    stack: int = Field(67108864, ge=-1, description="Stack size limit in bytes (64 MiB as NVIDIA's containers use).")
    nofile: int = Field(1048576, ge=1024, description="Open files (Ray's object store and NCCL sockets need many).")


class ContainerConfig(_Model):
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


class RecoveryConfig(_Model):
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


class ImageTransferConfig(_Model):
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


class ModelSyncConfig(_Model):
    enabled: bool = Field(
        False,
        description="Copy the model directory from the copy source (fabricCopy.source) to every node where it "
        "differs or is missing, over the fabric: only files whose size or time differ, symlinks kept, files the "
        "source lacks removed. Off: every node must hold the model already.",
    )
    timeout_seconds: PositiveInt = Field(14400, description="How long one node may take to receive the model.")
    progress_seconds: PositiveInt = Field(10, description="How often `pulumi up` shows each node's copy progress.")


class FabricCopyConfig(_Model):
    source: Optional[DnsLabel] = Field(
        None,
        description="The node the others receive the image (imageTransfer.method copy) and the model (modelSync) "
        "from. Default: the head.",
    )
    port: Port = Field(29650, description="TCP port of the copy depot on the source's fabric address.")


class MemoryConfig(_Model):
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


class SshConfig(_Model):
    dial_error_limit: int = Field(
        20,
        ge=1,
        le=1000,
        description="Failed SSH dials each remote command retries before it fails (pulumi-command's "
        "dialErrorLimit; the wait between dials grows to 5 s): 20 is about a minute, through a reboot or a busy sshd. "
        "Lower it to fail fast on a node that is down.",
    )


class BenchmarkConfig(_Model):
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


class ReleaseConfig(_Model):
    min_output_tokens_per_second: Optional[float] = Field(
        None, gt=0, description="With promoteFrom: refuse a release whose benchmark made fewer output tokens/s."
    )
    max_p99_ttft_ms: Optional[float] = Field(
        None, gt=0, description="With promoteFrom: refuse a release whose benchmark's p99 time to first token was "
        "higher (ms).",
    )  # fmt: skip


class MetricsConfig(_Model):
    prometheus_node: Optional[DnsLabel] = Field(
        None,
        description="A node that runs Prometheus (container spark-vllm.prometheus, data on the volume "
        "spark-vllm-prometheus) scraping every target of the `prometheusConfig` output.",
    )
    prometheus_image: ImageRef = Field("prom/prometheus:v3.5.0", description="Image of that Prometheus.")
    prometheus_port: Port = Field(9090, description="Port of that Prometheus's web UI and API.")
    scrape_interval_seconds: int = Field(15, ge=1, le=3600, description="How often every target is scraped.")
    retention_days: PositiveInt = Field(15, description="How long Prometheus keeps its samples.")


class SecurityConfig(_Model):
    require_host_keys: bool = Field(False, description="Refuse nodes without hostKey instead of warning.")


class ClusterConfig(_Model):
    """The whole `spark-vllm:` namespace of a stack."""

    nodes: list[NodeConfig] = Field(min_length=1, description="The machines, in order.")
    head: Optional[DnsLabel] = Field(
        None, description="Node running the Ray head and vLLM's API server (rank 0). Default: the first."
    )
    image: Optional[ImageRef] = Field(
        None, description="Container image with vLLM and Ray; pinned to the pulled image id on every node."
    )
    model: Optional[ModelRef] = Field(
        None,
        description="Model path (mounted read-only at the same path on every node; normalised, not a system or home "
        "directory) or Hugging Face repo id.",
    )
    executor: Literal["auto", "ray", "mp"] = Field(
        "auto",
        description="How vLLM spans the nodes: 'ray' (Ray head and workers, `vllm serve` on the head) or 'mp' "
        "(vLLM's own multi-node executor: `vllm serve` on every node, `--headless` on the workers). 'auto' picks "
        "by the image: mp for the stock vllm/vllm-openai image (no Ray in it since v0.19), ray for other images "
        "(Spark builds carry Ray); the image check on every node confirms it before any container starts.",
    )
    tensor_parallel_size: PositiveInt = Field(1, description="`--tensor-parallel-size`.")
    pipeline_parallel_size: PositiveInt = Field(
        1, description="`--pipeline-parallel-size`. TP × PP = GPUs of all nodes."
    )
    max_model_len: Optional[PositiveInt] = Field(None, description="`--max-model-len`.")
    smoke_test: bool = Field(True, description="Send one chat completion after the server is ready.")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="`vllm serve` settings.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster settings.")
    nccl: NcclConfig = Field(default_factory=NcclConfig, description="NCCL settings.")
    network: NetworkConfig = Field(default_factory=NetworkConfig, description="Fabric network management.")
    fabric: FabricConfig = Field(default_factory=FabricConfig, description="The fabric gate: the link checked first.")
    container: ContainerConfig = Field(default_factory=ContainerConfig, description="The node containers' settings.")
    memory_check: Literal["enforce", "warn", "off"] = Field(
        "enforce",
        description="The memory plan (weights, KV cache for maxModelLen, allowance) against each node's memory, "
        "before anything starts: stop the deploy when it does not fit, warn, or skip it.",
    )
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="Memory plan settings.")
    recovery: RecoveryConfig = Field(
        default_factory=RecoveryConfig, description="How each node's supervisor restarts vLLM after it exits."
    )
    image_transfer: ImageTransferConfig = Field(
        default_factory=ImageTransferConfig, description="How the image reaches each node."
    )
    model_sync: ModelSyncConfig = Field(
        default_factory=ModelSyncConfig, description="The model copied from the copy source to the other nodes."
    )
    fabric_copy: FabricCopyConfig = Field(
        default_factory=FabricCopyConfig, description="Where copies over the fabric come from."
    )
    ssh: SshConfig = Field(default_factory=SshConfig, description="How the remote commands reach the nodes.")
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig, description="How fast it serves, after deploy.")
    release: ReleaseConfig = Field(default_factory=ReleaseConfig, description="Floors a promoted release must meet.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus targets, and a Prometheus.")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="Security switches.")
    promote_from: Optional[StackName] = Field(
        None, description="Stack whose validated release (image digest, model, engine settings) this stack deploys."
    )
    promote_fingerprint: Optional[
        Annotated[str, _pattern(r"[0-9a-f]{16}", "a release fingerprint (16 hex digits)")]
    ] = Field(
        None,
        description="With promoteFrom: deploy only the release with this fingerprint (the one reviewed).",
    )
    api_key: Optional[TokenSecret] = Field(None, description="Secret. API key clients must send to /v1 (VLLM_API_KEY).")
    hf_token: Optional[TokenSecret] = Field(
        None, description="Secret. Hugging Face token (HF_TOKEN in the containers)."
    )
    ssh_private_key: Optional[PrivateKeySecret] = Field(
        None,
        description="Secret. SSH private key for every node, used by both transports. Default: the ssh-agent at "
        "SSH_AUTH_SOCK (~/.ssh/id_* alone is not enough: remote commands never read it).",
    )

    _executor_reason: Optional[str] = PrivateAttr(None)  # why executor auto chose what it did

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_executor(cls, data: Any, handler: Any) -> ClusterConfig:
        """executor auto becomes ray or mp here (from the image), so every rule and renderer sees one of them."""
        reason = None
        if isinstance(data, dict) and data.get("executor", "auto") == "auto":
            chosen, reason = auto_executor(data.get("image"))
            data = {**data, "executor": chosen}
        model = handler(data)
        model._executor_reason = reason
        return model

    @property
    def executor_reason(self) -> Optional[str]:
        """With executor auto: which executor it chose and why (None when the config names one)."""
        return self._executor_reason

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ClusterConfig:
        problems = [*_node_problems(self), *_fabric_address_problems(self), *_parallelism_problems(self)]
        problems += _serving_problems(self)
        problems += _runtime_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def head_node(self) -> NodeConfig:
        name = self.head or self.nodes[0].name
        return next(node for node in self.nodes if node.name == name)

    @property
    def copy_source(self) -> NodeConfig:
        """The node the others receive the image and the model from."""
        name = self.fabric_copy.source or self.head_node.name
        return next(node for node in self.nodes if node.name == name)

    @property
    def uses_depot(self) -> bool:
        """Whether the copy source runs a depot (something is copied over the fabric)."""
        return len(self.nodes) > 1 and (self.image_transfer.method == "copy" or self.model_sync.enabled)

    @property
    def downloads_once(self) -> bool:
        """Whether a Hugging Face repo id is downloaded once on the copy source and synced from there
        (modelSync with container.hfCacheDir; a promoted release may turn out to be a path)."""
        return (
            self.uses_depot
            and self.model_sync.enabled
            and self.container.hf_cache_dir is not None
            and not (self.model or "").startswith("/")
        )

    def synced_model_dir(self, model: str) -> str:
        """What modelSync reads on the source and writes on the others for `model`: the directory, or
        for a repo id its repository in the Hugging Face cache (blobs, refs and snapshots)."""
        if model.startswith("/"):
            return model
        if self.container.hf_cache_dir is None:
            raise ValueError(f"modelSync of the repo id {model!r} needs container.hfCacheDir")
        return f"{self.container.hf_cache_dir.rstrip('/')}/hub/models--{model.replace('/', '--')}"

    @property
    def workers(self) -> list[NodeConfig]:
        return [node for node in self.nodes if node.name != self.head_node.name]

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def served_model_name(self) -> str:
        return self.vllm.served_model_name or (self.model or "")


SECRET_KEYS = ("apiKey", "hfToken", "sshPrivateKey")
# The stock vLLM image ships without Ray since this release (vLLM 0.19 made its own mp executor the
# multi-node default); NVIDIA's Spark playbook and community Spark images add Ray themselves.
STOCK_IMAGE = "vllm/vllm-openai"
STOCK_WITHOUT_RAY_SINCE = (0, 19)


def _image_repository_and_tag(image: str) -> tuple[str, Optional[str]]:
    name = image.split("@", 1)[0]
    repository, tag = name, None
    if ":" in name.rsplit("/", 1)[-1]:
        repository, tag = name.rsplit(":", 1)
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        repository = repository.removeprefix(prefix)
    return repository, tag


def auto_executor(image: Any) -> tuple[str, str]:
    """(executor, why) for executor auto: mp for the stock vllm/vllm-openai image (no Ray in it since
    v0.19), ray for every other image (the Spark images people run carry Ray) and without an image
    (promoteFrom: the release's image is known only later, and the image check catches a missing Ray)."""
    if not isinstance(image, str) or not image:
        return (
            "ray",
            "executor auto: ray (no image in the config: promoteFrom decides it; the image check refuses an image "
            "without Ray)",
        )
    repository, tag = _image_repository_and_tag(image)
    if repository != STOCK_IMAGE:
        return "ray", f"executor auto: ray ({image} is not the stock {STOCK_IMAGE} image, and Spark images carry Ray)"
    found = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)*(rc\d+|\.post\d+)?", tag or "")
    if found and (int(found.group(1)), int(found.group(2))) < STOCK_WITHOUT_RAY_SINCE:
        return "ray", f"executor auto: ray ({image}: the stock image carried Ray before vLLM 0.19)"
    return "mp", f"executor auto: mp ({image}: the stock vLLM image has no Ray since vLLM 0.19)"


def _problem(path: str, value: Any, expected: str) -> str:
    return f"{path}: {value!r} — {expected}"


class _Invalid:
    """A value that failed its own field rule: cross-field rules leave it to that message."""

    def __repr__(self) -> str:
        return "<invalid>"


INVALID = _Invalid()


def _submodel(annotation: Any) -> tuple[Optional[type[BaseModel]], bool]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is list:
        inner = typing.get_args(annotation)[0]
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner, True
    return None, False


def _lenient(model: type[BaseModel], raw: Any) -> Any:
    """The raw config as attributes, each field validated on its own: invalid ones become INVALID.

    Lets the cross-field rules run even when some fields are wrong, so one error lists everything.
    """
    if not isinstance(raw, dict):
        return INVALID
    if model is ClusterConfig and raw.get("executor", "auto") == "auto":
        raw = {**raw, "executor": auto_executor(raw.get("image"))[0]}  # as the model resolves it
    values = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in raw:
            # A missing required key has its own "Field required" message.
            values[name] = INVALID if field.is_required() else field.get_default(call_default_factory=True)
            continue
        sub, is_list = _submodel(field.annotation)
        value = raw[key]
        if sub is not None and is_list:
            values[name] = [_lenient(sub, v) for v in value] if isinstance(value, list) else INVALID
        elif sub is not None:
            values[name] = _lenient(sub, value)
        else:
            try:
                annotation = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
                values[name] = TypeAdapter(annotation).validate_python(value)
            except ValidationError:
                values[name] = INVALID
    return SimpleNamespace(**values, raw=raw)


def _node_problems(cfg: Any) -> list[str]:
    problems: list[str] = []
    seen_names: dict[str, int] = {}
    seen_fabric: dict[str, int] = {}
    seen_machines: dict[tuple[str, int], int] = {}
    if cfg.nodes is INVALID:
        return problems
    for index, node in enumerate(cfg.nodes):
        if node is INVALID:
            continue
        if node.name is INVALID:
            pass
        elif node.name in seen_names:
            problems.append(
                _problem(f"nodes[{index}].name", node.name, f"a unique name (nodes[{seen_names[node.name]}] has it)")
            )
        else:
            seen_names[node.name] = index
        address = str(node.fabric_address)
        if node.fabric_address is INVALID:
            pass
        elif address in seen_fabric:
            problems.append(
                _problem(
                    f"nodes[{index}].fabricAddress",
                    address,
                    f"a unique address (nodes[{seen_fabric[address]}] has it)",
                )
            )
        else:
            seen_fabric[address] = index
        if INVALID not in (node.host, node.ssh_port):
            machine = (node.host.lower(), node.ssh_port)
            if machine in seen_machines:
                other = seen_machines[machine]
                other_name = cfg.nodes[other].name
                problems.append(
                    _problem(
                        f"nodes[{index}].host",
                        node.host,
                        f"a machine no other node has: nodes[{other}] ({other_name}) is {node.host} port "
                        f"{node.ssh_port} too, and two Ray nodes on one machine claim the same GPU and ports "
                        "(a machine with several GPUs is one node with gpus: N)",
                    )
                )
            else:
                seen_machines[machine] = index
        if cfg.security is not INVALID and cfg.security.require_host_keys is True and node.host_key is None:
            problems.append(
                _problem(
                    f"nodes[{index}].hostKey",
                    None,
                    "the node's public host key, because security.requireHostKeys is true "
                    f"(get it with `ssh-keyscan -p {node.ssh_port} -t ed25519 {node.host}`)",
                )
            )
    # A head naming a node whose own name is invalid is left to that node's message.
    raw_names = [node.raw.get("name") for node in cfg.nodes if node is not INVALID and node.name is INVALID]
    if cfg.head not in (None, INVALID) and cfg.head not in seen_names and cfg.head not in raw_names:
        problems.append(_problem("head", cfg.head, f"one of the node names {sorted(seen_names)}"))
    source = cfg.fabric_copy.source if cfg.fabric_copy is not INVALID else None
    if source not in (None, INVALID) and source not in seen_names and source not in raw_names:
        problems.append(_problem("fabricCopy.source", source, f"one of the node names {sorted(seen_names)}"))
    return problems


def _fabric_address_problems(cfg: Any) -> list[str]:
    """Fabric addresses that can never carry Ray, NCCL and Gloo between the nodes; with network.manage,
    addresses that the netplan it writes would not put on one subnet."""
    if cfg.nodes is INVALID:
        return []
    problems: list[str] = []
    several = len(cfg.nodes) > 1
    valid = [(i, n) for i, n in enumerate(cfg.nodes) if n is not INVALID and n.fabric_address is not INVALID]
    for index, node in valid:
        address = node.fabric_address
        why = None
        if address.is_unspecified:
            why = "0.0.0.0 means every address, not one"
        elif address.is_multicast:
            why = "a multicast address (224.0.0.0/4) is no host's"
        elif address == ipaddress.IPv4Address("255.255.255.255") or address in ipaddress.IPv4Network("240.0.0.0/4"):
            why = "a reserved or broadcast address is no host's"
        elif several and address.is_loopback:
            why = "a loopback address never leaves its own machine, and the other nodes must reach it"
        elif several and address.is_link_local:
            why = (
                "a link-local address (169.254.0.0/16) is what an interface takes when no address was set; "
                "it is not the fabric's"
            )
        if why:
            problems.append(
                _problem(
                    f"nodes[{index}].fabricAddress",
                    str(address),
                    f"the node's address on the RoCE/InfiniBand link (e.g. 192.168.100.10): {why}",
                )
            )
    network = cfg.network
    if not several or network is INVALID or network.manage is not True or network.prefix_length is INVALID:
        return problems
    prefix = network.prefix_length
    subnets: dict[ipaddress.IPv4Network, list[str]] = {}
    for index, node in valid:
        subnet = ipaddress.IPv4Network(f"{node.fabric_address}/{prefix}", strict=False)
        subnets.setdefault(subnet, []).append(node.name if node.name is not INVALID else f"nodes[{index}]")
        if prefix <= 30 and node.fabric_address in (subnet.network_address, subnet.broadcast_address):
            kind = "network" if node.fabric_address == subnet.network_address else "broadcast"
            problems.append(
                _problem(
                    f"nodes[{index}].fabricAddress",
                    str(node.fabric_address),
                    f"a host address of {subnet}: with network.manage the netplan gives it prefix {prefix}, "
                    f"where it is the {kind} address",
                )
            )
    if len(subnets) > 1:
        listing = "; ".join(f"{subnet}: {', '.join(names)}" for subnet, names in subnets.items())
        problems.append(
            _problem(
                "network.prefixLength",
                prefix,
                f"one subnet holding every fabricAddress, because network.manage writes each node's address with "
                f"this prefix and the nodes then reach each other only inside it; at /{prefix} they fall in "
                f"{len(subnets)} ({listing}): change the addresses or the prefix length",
            )
        )
    return problems


def _parallelism_problems(cfg: Any) -> list[str]:
    facts = [cfg.nodes, cfg.tensor_parallel_size, cfg.pipeline_parallel_size]
    if INVALID in facts or not cfg.nodes or any(node is INVALID or node.gpus is INVALID for node in cfg.nodes):
        return []
    if cfg.executor == "mp" and len({node.gpus for node in cfg.nodes}) > 1:
        counts = ", ".join(f"{n.name if n.name is not INVALID else '?'}: {n.gpus}" for n in cfg.nodes)
        return [
            _problem(
                "nodes[].gpus",
                counts,
                "the same number on every node with executor mp (vLLM runs TP × PP / nodes ranks on each)",
            )
        ]
    total_gpus = sum(node.gpus for node in cfg.nodes)
    world = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if world == total_gpus:
        return []
    value = f"{cfg.tensor_parallel_size} × {cfg.pipeline_parallel_size} = {world}"
    if world < total_gpus:
        kept, gpus = 0, 0
        while gpus < world:
            gpus += cfg.nodes[kept].gpus
            kept += 1
        labels = [n.name if n.name is not INVALID else f"nodes[{i}]" for i, n in enumerate(cfg.nodes)]
        hint = f"drop nodes {labels[kept:]}" if gpus == world else ""
    else:
        hint = ""
    fits = [f"TP {tp} × PP {total_gpus // tp}" for tp in range(1, total_gpus + 1) if total_gpus % tp == 0]
    advice = "; ".join(part for part in (hint, "or use " + " or ".join(fits)) if part)
    return [
        _problem(
            "tensorParallelSize × pipelineParallelSize",
            value,
            f"the GPUs of the listed nodes ({total_gpus}): {advice}",
        )
    ]


def _serving_problems(cfg: Any) -> list[str]:
    problems: list[str] = []
    if cfg.promote_from is INVALID:
        pass
    elif cfg.promote_from is None:
        for key in ("image", "model"):
            if getattr(cfg, key) is None:
                problems.append(_problem(key, None, "a value (or promoteFrom: a stack whose release to deploy)"))
    else:
        for key in ("image", "model"):
            if getattr(cfg, key) not in (None, INVALID):
                problems.append(
                    _problem(
                        key,
                        getattr(cfg, key),
                        f"no value: promoteFrom {cfg.promote_from!r} decides it (remove one of the two)",
                    )
                )
    if cfg.promote_fingerprint not in (None, INVALID) and cfg.promote_from is None:
        problems.append(_problem("promoteFingerprint", cfg.promote_fingerprint, "promoteFrom beside it (or remove it)"))
    release = cfg.release
    if release is not INVALID and cfg.promote_from is None:
        for key, value in (("minOutputTokensPerSecond", release.min_output_tokens_per_second),
                           ("maxP99TtftMs", release.max_p99_ttft_ms)):  # fmt: skip
            if value not in (None, INVALID):
                problems.append(
                    _problem(f"release.{key}", value, "promoteFrom beside it: a floor for the promoted release")
                )
    problems += _benchmark_problems(cfg)
    if cfg.vllm is INVALID:
        return problems
    if cfg.vllm.enable_auto_tool_choice is True and cfg.vllm.tool_call_parser is None:
        problems.append(
            _problem("vllm.toolCallParser", None, "a parser (e.g. qwen3_coder) because enableAutoToolChoice is true")
        )
    host = cfg.vllm.host
    if host is not INVALID and not host.is_loopback and cfg.api_key is None and cfg.vllm.allow_unauthenticated is False:
        problems.append(
            _problem(
                "apiKey",
                None,
                f"a secret (`pulumi config set --secret apiKey …`) because vLLM binds {cfg.vllm.host}; "
                "or set vllm.allowUnauthenticated: true to serve without one",
            )
        )
    if cfg.vllm.extra_args is not INVALID:
        read = read_extra_args(cfg.vllm.extra_args)
        for index, shown, expected in read.problems:
            problems.append(_problem(f"vllm.extraArgs[{index}]", shown, expected))
        if isinstance(cfg.vllm.max_num_seqs, int) and read.has("--max-num-seqs"):
            problems.append(
                _problem(
                    "vllm.maxNumSeqs",
                    cfg.vllm.max_num_seqs,
                    "one place for it: vllm.extraArgs sets --max-num-seqs too (remove it there; the key is "
                    "checked against the memory plan)",
                )
            )
    return problems


def _benchmark_problems(cfg: Any) -> list[str]:
    """The benchmark's requests fit the context; the metrics' Prometheus names a node the guard lets in."""
    problems: list[str] = []
    bench = cfg.benchmark
    if bench is not INVALID and bench.enabled is True and isinstance(cfg.max_model_len, int):
        if INVALID not in (bench.prompt_tokens, bench.output_tokens):
            total = bench.prompt_tokens + bench.output_tokens
            if total > cfg.max_model_len:
                problems.append(
                    _problem(
                        "benchmark.promptTokens + benchmark.outputTokens",
                        total,
                        f"at most maxModelLen ({cfg.max_model_len}): vLLM refuses longer requests",
                    )
                )
    metrics = cfg.metrics
    if metrics is INVALID or metrics.prometheus_node in (None, INVALID) or cfg.nodes is INVALID:
        return problems
    names = [node.name for node in cfg.nodes if node is not INVALID]
    if metrics.prometheus_node not in names:
        problems.append(_problem("metrics.prometheusNode", metrics.prometheus_node, f"one of the nodes {names}"))
        return problems
    node = next(n for n in cfg.nodes if n is not INVALID and n.name == metrics.prometheus_node)
    head = cfg.head if cfg.head not in (None, INVALID) else cfg.nodes[0].name
    vllm = cfg.vllm
    if node.name != head and vllm is not INVALID and vllm.host is not INVALID and vllm.host.is_loopback:
        problems.append(
            _problem(
                "metrics.prometheusNode",
                node.name,
                f"the head ({head}): vLLM binds {vllm.host} (vllm.host), which only the head itself reaches",
            )
        )
    network = cfg.network
    sources = [] if network is INVALID or network.api_sources is INVALID else network.api_sources
    if node.name != head and sources and node.fabric_address is not INVALID:
        if not any(node.fabric_address in source for source in sources):
            problems.append(
                _problem(
                    "network.apiSources",
                    [str(source) for source in sources],
                    f"a network holding {node.fabric_address}, metrics.prometheusNode {node.name}'s fabric address: "
                    "its Prometheus scrapes vLLM's /metrics on the head",
                )
            )
    return problems


# Ray's listeners: (key under `ray`, on the head only, what listens there).
RAY_CLIENT_KEY, RAY_CLIENT_PORT = "Ray's fixed client port", 10001
# Where Ray's raylet, object manager, agents and metrics listen, and NCCL/Gloo/torch: ports the kernel
# hands out (net.ipv4.ip_local_port_range; Linux's default range, which network.guard reads on the node).
EPHEMERAL_KEY, EPHEMERAL_RANGE = "the kernel's ephemeral range", (32768, 60999)


@dataclass(frozen=True)
class Listener:
    """A port (or a range of ports) something the program starts, or sshd, listens on at a node."""

    key: str  # the config key that sets it
    what: str
    first: int
    last: int
    default: bool  # the key's value is its default (so a clash is more likely the other key's doing)

    def __str__(self) -> str:
        where = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.key} {where} ({self.what})"

    def overlaps(self, other: Listener) -> bool:
        return self.first <= other.last and other.first <= self.last


def _default(model: type[BaseModel], field: str) -> int:
    return model.model_fields[field].default


def node_listeners(cfg: Any, index: int) -> list[Listener]:
    """What listens on `node`'s ports with this config. Works on a validated config and on the lenient
    view alike: keys that are invalid (or undecidable) are left out."""

    def valid(*values: Any) -> bool:
        return INVALID not in values and None not in values

    found: list[Listener] = []

    def add(key: str, what: str, first: Any, last: Any = None, default: Any = None) -> None:
        """`default`: the key's default (first, last); None for a port no key sets."""
        last = first if last is None else last
        if valid(first, last):
            found.append(Listener(key, what, first, last, default is None or (first, last) == default))

    def single(model: type[BaseModel], field: str) -> tuple[int, int]:
        return _default(model, field), _default(model, field)

    node = cfg.nodes[index]
    add(f"nodes[{index}].sshPort", "sshd, never touched", node.ssh_port, default=single(NodeConfig, "ssh_port"))
    head_name = cfg.head if cfg.head not in (None, INVALID) else cfg.nodes[0].name
    is_head = node.name == head_name
    vllm = cfg.vllm
    if is_head and vllm is not INVALID:
        add("vllm.port", "vLLM API server", vllm.port, default=single(VllmConfig, "port"))
    if cfg.executor == "mp" and is_head and vllm is not INVALID and len(cfg.nodes) > 1:
        add(
            "vllm.masterPort",
            "vLLM rank 0 with executor mp",
            vllm.master_port,
            default=single(VllmConfig, "master_port"),
        )
    ray = cfg.ray
    if cfg.executor == "ray" and ray is not INVALID:
        if is_head:
            add("ray.port", "Ray GCS", ray.port, default=single(RayConfig, "port"))
            if ray.dashboard is True:
                add(
                    "ray.dashboardPort",
                    "Ray dashboard",
                    ray.dashboard_port,
                    default=single(RayConfig, "dashboard_port"),
                )
            # Not settable without the `ray[client]` extra (`ray start` refuses the flag), so Ray's own.
            add(RAY_CLIENT_KEY, "Ray Client server, with ray[client]", RAY_CLIENT_PORT)
        if valid(ray.min_worker_port, ray.max_worker_port) and ray.min_worker_port <= ray.max_worker_port:
            workers = (_default(RayConfig, "min_worker_port"), _default(RayConfig, "max_worker_port"))
            add("ray.minWorkerPort-maxWorkerPort", "Ray worker processes", ray.min_worker_port, ray.max_worker_port,
                default=workers)  # fmt: skip
        if ray.metrics_export_port is not None:
            add("ray.metricsExportPort", "Ray's metrics", ray.metrics_export_port)
        add(EPHEMERAL_KEY, "Ray's raylet, object manager and agents, NCCL, Gloo", *EPHEMERAL_RANGE)
    fabric = cfg.fabric
    testing = fabric is not INVALID and len(cfg.nodes) > 1 and fabric.gate != "off"
    if testing and fabric.bandwidth_test == "tcp":
        add("fabric.testPort", "fabric gate's bandwidth test, during the checks", fabric.test_port,
            default=single(FabricConfig, "test_port"))  # fmt: skip
    if testing and fabric.bandwidth_test == "nccl" and is_head:  # the other ranks only connect
        add("fabric.testPort", "the NCCL test's rendezvous, during the checks", fabric.test_port,
            default=single(FabricConfig, "test_port"))  # fmt: skip
    metrics = cfg.metrics
    if metrics is not INVALID and metrics.prometheus_node == node.name:
        add("metrics.prometheusPort", "Prometheus", metrics.prometheus_port,
            default=single(MetricsConfig, "prometheus_port"))  # fmt: skip
    transfer, sync, copy = cfg.image_transfer, cfg.model_sync, cfg.fabric_copy
    copying = (transfer is not INVALID and transfer.method == "copy") or (sync is not INVALID and sync.enabled is True)
    if copying and copy is not INVALID and len(cfg.nodes) > 1:
        source = copy.source if copy.source is not None else head_name
        if node.name == source:
            add("fabricCopy.port", "fabric copy depot", copy.port, default=single(FabricCopyConfig, "port"))
    return found


def _port_problems(cfg: Any) -> list[str]:
    """One listener a port on each node: with host networking the second dies at start."""
    problems: list[str] = []
    ray = cfg.ray
    if ray is not INVALID and INVALID not in (ray.min_worker_port, ray.max_worker_port):
        if ray.max_worker_port < ray.min_worker_port:
            problems.append(
                _problem(
                    "ray.maxWorkerPort", ray.max_worker_port, f"at least ray.minWorkerPort ({ray.min_worker_port})"
                )
            )
    if cfg.nodes is INVALID or any(n is INVALID or n.name is INVALID for n in cfg.nodes):
        return problems
    for index, node in enumerate(cfg.nodes):
        listeners = node_listeners(cfg, index)
        for later, listener in enumerate(listeners):
            clash = next((other for other in listeners[:later] if other.overlaps(listener)), None)
            if clash is None:
                continue
            # Name the key most likely at fault: a single port before a range, a changed value before a default.
            singles = [item for item in (listener, clash) if item.first == item.last] or [listener]
            blamed = next((item for item in singles if not item.default), singles[0])
            line = _problem(
                blamed.key,
                blamed.first,
                f"a port nothing else on node {node.name} listens on: {clash} and {listener} collide "
                f"(ports in use there: {'; '.join(str(item) for item in listeners)})",
            )
            if line.split(" — ")[0] not in {p.split(" — ")[0] for p in problems}:
                problems.append(line)
    return problems


def _runtime_problems(cfg: Any) -> list[str]:
    """The recovery backoff grows from backoffSeconds to maxBackoffSeconds; modelSync copies directories;
    ports are unique on each node (_port_problems)."""
    problems = []
    recovery = cfg.recovery
    if recovery is not INVALID and INVALID not in (recovery.backoff_seconds, recovery.max_backoff_seconds):
        if recovery.max_backoff_seconds < recovery.backoff_seconds:
            problems.append(
                _problem(
                    "recovery.maxBackoffSeconds",
                    recovery.max_backoff_seconds,
                    f"at least recovery.backoffSeconds ({recovery.backoff_seconds})",
                )
            )
    problems += _port_problems(cfg)
    network = cfg.network
    if network is not INVALID and network.api_sources not in (INVALID, []) and network.guard is False:
        sources = [str(source) for source in network.api_sources]
        problems.append(
            _problem("network.apiSources", sources, "network.guard: true beside it (the guard enforces it)")
        )
    sync = cfg.model_sync
    container = cfg.container
    fabric = cfg.fabric
    if (
        fabric is not INVALID
        and fabric.bandwidth_test == "nccl"
        and fabric.gate != "off"
        and container is not INVALID
        and container.gpus is False
    ):
        problems.append(
            _problem(
                "fabric.bandwidthTest",
                "nccl",
                "tcp or off with container.gpus: false (the NCCL test runs on the nodes' GPUs)",
            )
        )
    if (
        sync is not INVALID
        and sync.enabled is True
        and cfg.model not in (None, INVALID)
        and not cfg.model.startswith("/")
        and container is not INVALID
        and container.hf_cache_dir is None
    ):
        problems.append(
            _problem(
                "container.hfCacheDir",
                None,
                f"a host directory, because modelSync copies model {cfg.model!r}, a Hugging Face repo id: the copy "
                "source downloads it there once and the other nodes receive it at the same path (a Docker volume "
                "cannot be copied over SSH)",
            )
        )
    return problems


class ConfigError(Exception):
    """A stack config that breaks one or more rules. The message lists every problem, one a line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"spark-vllm: the stack config has {len(problems)} problem(s):\n{lines}")


def _key_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The model that owns the keys at `loc` (list indexes skipped), or None."""
    model: Optional[type[BaseModel]] = ClusterConfig
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        model = _submodel(field.annotation)[0] if field else None
    return model


def config_keys(model: Optional[type[BaseModel]] = None, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every key of the stack config with its full path (`nodes[].gpus`) and its field: a model's own
    keys first, then each nested model's (the order of docs/config.md's reference)."""
    nested = []
    for name, field in (model or ClusterConfig).model_fields.items():
        path = prefix + (field.alias or name)
        yield path, field
        sub, is_list = _submodel(field.annotation)
        if sub is not None:
            nested.append((sub, path + ("[]." if is_list else ".")))
    for sub, sub_prefix in nested:
        yield from config_keys(sub, sub_prefix)


# Keys that existed once: their unknown-key message says why they went instead of guessing.
REMOVED_KEYS = {
    "container.shmSizeMb": "no longer a key: Docker ignores a shared-memory size when the container shares the host's "
    "IPC namespace (ipc host, which NCCL and vLLM need), so /dev/shm is the host's; remove it",
}


def _unknown_key_hint(loc: tuple) -> str:
    removed = REMOVED_KEYS.get(_key_path(tuple(p for p in loc if not isinstance(p, int))))
    if removed:
        return removed
    key, owner = str(loc[-1]), _model_at(loc[:-1])
    here = [f.alias or n for n, f in owner.model_fields.items()] if owner else []
    by_lower = {k.lower(): k for k in here}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    if close:
        return f"no such key: did you mean {by_lower[close[0]]!r}?"
    elsewhere = next((path for path, _ in config_keys() if path.rsplit(".", 1)[-1] == key), None)
    if elsewhere:
        where = "the top level" if elsewhere == key else elsewhere
        return f"no such key here: {key!r} belongs at {where}"
    return f"no such key (known here: {', '.join(here)})" if here else "no such key"


def _describe(error: dict) -> list[str]:
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
    if not error["loc"]:
        # Cross-field rules arrive already formatted, one problem a line.
        return message.splitlines()
    value = error.get("input")
    if error["type"] == "missing":
        value = None
    elif error["type"] == "extra_forbidden":
        message = _unknown_key_hint(error["loc"])
    if isinstance(value, SecretStr) or (error["loc"] and error["loc"][-1] in SECRET_KEYS):
        value = "[secret]"
    return [_problem(_key_path(error["loc"]), value, message)]


def _plain_secret_problems(raw: dict[str, Any], plain: Collection[str]) -> list[str]:
    problems = []
    for key in SECRET_KEYS:
        if key in raw and key in plain:
            value = "< ~/.ssh/id_ed25519" if key == "sshPrivateKey" else "…"
            problems.append(
                _problem(
                    key,
                    "[set in plain text]",
                    f"a Pulumi secret: as it is, the value sits readable in Pulumi.<stack>.yaml, which gets committed; "
                    f"run `pulumi config rm {key}` then `pulumi config set --secret {key} {value}` "
                    "(and change the value if that file was shared)",
                )
            )
    return problems


def _edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment): a swapped pair of letters counts once."""
    rows = [list(range(len(b) + 1))] + [[i] + [0] * len(b) for i in range(1, len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[-1][-1]


def near_namespace(namespace: str) -> bool:
    """Whether `namespace` is a misspelling of this project's (`spark_vllm`, `Spark-vLLM`, `spark-vlm`,
    `sprak-vllm`), not another namespace (`docker`, `pulumi`, `aws`)."""
    if namespace == NAMESPACE:
        return False
    folded = re.sub(r"[^a-z0-9]", "", namespace.lower())
    return folded == re.sub(r"[^a-z0-9]", "", NAMESPACE) or _edit_distance(namespace.lower(), NAMESPACE) <= 2


def namespace_problems(foreign: Mapping[str, Any], secret: Collection[str] = ()) -> list[str]:
    """Keys of another namespace (`full key → value`) that misspell this project's: Pulumi hands them to
    the program like any other namespace's, and the program would never read them. `secret` names the
    full keys held as secrets (their values are not shown)."""
    problems = []
    for full_key in sorted(foreign):
        namespace, sep, key = full_key.partition(":")
        if not sep or not near_namespace(namespace):
            continue
        value = "[secret]" if full_key in secret or key in SECRET_KEYS else foreign[full_key]
        flag = "--secret " if full_key in secret or key in SECRET_KEYS else ""
        problems.append(
            _problem(
                full_key,
                value,
                f"a key of the {NAMESPACE!r} namespace: {namespace!r} is not {NAMESPACE!r}, so the program never "
                f"reads it; `pulumi config rm {shlex.quote(full_key)}` then `pulumi config set {flag}--path "
                f"{shlex.quote(NAMESPACE + ':' + key)} …`",
            )
        )
    return problems


def _qualified(name: str, this_stack: str) -> tuple[str, ...]:
    """A stack name as organization/project/stack, filled from `this_stack` (Pulumi reads `stack` and
    `organization/stack` within the current project)."""
    organization, project, _ = this_stack.split("/")
    parts = name.split("/")
    if len(parts) == 1:
        return organization, project, parts[0]
    if len(parts) == 2:
        return parts[0], project, parts[1]
    return tuple(parts)


def _self_promotion_problems(raw: dict[str, Any], this_stack: Optional[str]) -> list[str]:
    promote = raw.get("promoteFrom")
    if this_stack is None or not isinstance(promote, str) or this_stack.count("/") != 2:
        return []
    if _qualified(promote, this_stack) != tuple(this_stack.split("/")):
        return []
    return [
        _problem(
            "promoteFrom",
            promote,
            f"another stack than this one ({this_stack}): a stack promoting from itself redeploys its own last "
            "release and validates nothing; name the stack that validated the release (e.g. "
            f"{this_stack.rsplit('/', 1)[0]}/staging)",
        )
    ]


def load_cluster_config(
    raw: dict[str, Any],
    plain: Collection[str] = (),
    *,
    this_stack: Optional[str] = None,
    foreign: Optional[Mapping[str, Any]] = None,
    foreign_secret: Collection[str] = (),
) -> ClusterConfig:
    """Validate the `spark-vllm:` namespace given as a dict of camelCase keys. `plain` names the keys
    the stack holds in plain text (not `--secret`): any of apiKey, hfToken, sshPrivateKey there is refused.
    `this_stack` (organization/project/stack) refuses a promoteFrom of itself; `foreign` (the stack's
    keys of other namespaces, `foreign_secret` those held as secrets) refuses a misspelt namespace.

    Raises ConfigError naming every problem; nothing else in the program runs before this.
    """
    outer_problems = _plain_secret_problems(raw, plain)
    outer_problems += _self_promotion_problems(raw, this_stack)
    outer_problems += namespace_problems(foreign or {}, foreign_secret)
    try:
        cfg = ClusterConfig.model_validate(raw)
    except ValidationError as error:
        problems = [line for item in error.errors() for line in _describe(item)]
    else:
        if not outer_problems:
            return cfg
        raise ConfigError(outer_problems)
    problems += [line for line in outer_problems if line not in problems]
    view = _lenient(ClusterConfig, raw)
    if view is not INVALID:
        for line in [
            *_node_problems(view),
            *_fabric_address_problems(view),
            *_parallelism_problems(view),
            *_serving_problems(view),
            *_runtime_problems(view),
        ]:
            if line not in problems:
                problems.append(line)
    raise ConfigError(problems)
