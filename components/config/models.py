"""The whole `spark-vllm:` namespace as one pydantic model, ClusterConfig, and what follows from it
(the head, the workers, the copy source). Its cross-field rules live in components/config/rules.py."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from components.config.deployments import DeploymentConfig, ModelSettings, RouterConfig
from components.config.sections import (
    BenchmarkConfig,
    ContainerConfig,
    EdgeConfig,
    FabricConfig,
    FabricCopyConfig,
    ImageTransferConfig,
    MemoryConfig,
    MetricsConfig,
    ModelSyncConfig,
    NcclConfig,
    NetworkConfig,
    NodeConfig,
    RecoveryConfig,
    ReleaseConfig,
    SecurityConfig,
    SshConfig,
    StrictModel,
    TlsConfig,
)
from components.config.types import (
    ClientKey,
    ClientName,
    DnsLabel,
    ImageRef,
    PasswordSecret,
    PrivateKeySecret,
    StackName,
    TokenSecret,
    matching,
)

SECRET_KEYS = ("apiKey", "apiKeys", "tls", "hfToken", "sshPrivateKey", "grafanaAdminPassword")
# The edge's names for the keys it accepts besides apiKeys': apiKey's, and the program's own (its steps through
# the edge, and the key the edge hands vLLM).
DEFAULT_CLIENT, PROGRAM_CLIENT = "default", "spark-vllm"
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


def resolve_raw(data: Any) -> tuple[Any, Optional[str]]:
    """The raw config with what `auto` and the defaults that depend on other keys resolve to (executor
    auto, each deployment's, the router's switch and node), and why executor auto chose what it did."""
    if not isinstance(data, dict):
        return data, None
    reason = None
    if data.get("executor", "auto") == "auto" and not data.get("deployments"):
        chosen, reason = auto_executor(data.get("image"))
        data = {**data, "executor": chosen}
    if isinstance(data.get("deployments"), list):
        data = {**data, "deployments": [_resolved(each, data.get("image")) for each in data["deployments"]]}
    return _router_resolved(data), reason


def _resolved(deployment: Any, image: Any) -> Any:
    """A deployment's executor auto: mp where each replica has one node (vLLM on one node needs no Ray),
    else as the top-level one resolves (by the image)."""
    if not isinstance(deployment, dict) or deployment.get("executor", "auto") != "auto":
        return deployment
    nodes, replicas = deployment.get("nodes"), deployment.get("replicas", 1)
    one_node = isinstance(nodes, list) and (len(nodes) == 1 or (isinstance(replicas, int) and len(nodes) == replicas))
    return {**deployment, "executor": "mp" if one_node else auto_executor(image)[0]}


def _router_resolved(data: dict) -> dict:
    """router.enabled and router.node as the stack runs them: on with several deployments or replicas, on
    the first deployment's head (a single-model stack's head); views of replicas copy them as they are."""
    router = data.get("router", {})
    deployments = data.get("deployments") or []
    if not isinstance(router, dict) or not isinstance(deployments, list):
        return data
    router = dict(router)
    if router.get("enabled") is None:
        many = len(deployments) > 1 or any(
            isinstance(each, dict) and isinstance(each.get("replicas"), int) and each["replicas"] > 1
            for each in deployments
        )
        router["enabled"] = many
    if router.get("node") is None:
        first = deployments[0] if deployments and isinstance(deployments[0], dict) else None
        nodes = data.get("nodes")
        found = None
        if first is not None and isinstance(first.get("nodes"), list) and first["nodes"]:
            found = first["nodes"][0]
        elif not deployments and data.get("head") is not None:
            found = data["head"]
        elif not deployments and isinstance(nodes, list) and nodes and isinstance(nodes[0], dict):
            found = nodes[0].get("name")
        if _is_label(found):  # else the key it comes from has its own message
            router["node"] = found
    return {**data, "router": router}


def _is_label(value: Any) -> bool:
    try:
        TypeAdapter(DnsLabel).validate_python(value)
    except ValidationError:
        return False
    return True


class _Machines(StrictModel):
    """The stack's nodes and image: the first keys of ClusterConfig (pydantic lists a class's fields after its
    bases', the last base's first), so problems and the config reference list them before one model's."""

    nodes: list[NodeConfig] = Field(min_length=1, description="The machines, in order.")
    head: Optional[DnsLabel] = Field(
        None, description="Node running the Ray head and vLLM's API server (rank 0). Default: the first."
    )
    image: Optional[ImageRef] = Field(
        None, description="Container image with vLLM and Ray; pinned to the pulled image id on every node."
    )


class ClusterConfig(ModelSettings, _Machines):
    """The whole `spark-vllm:` namespace of a stack: its machines, one model's settings (or `deployments`), and
    the rest."""

    smoke_test: bool = Field(True, description="Send one chat completion after the server is ready.")
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
    release: ReleaseConfig = Field(
        default_factory=ReleaseConfig,
        description="What a promoted release must meet: floors of its figures, the hosts it was validated on.",
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus targets, and a Prometheus.")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="Security switches.")
    deployments: list[DeploymentConfig] = Field(
        default_factory=list,
        description="Several models on these nodes, each a deployment with its own model, nodes, parallelism, "
        "executor, `vllm` and `ray` settings and replicas, behind the router. Empty: one model from the top-level "
        "keys (model, tensorParallelSize, pipelineParallelSize, maxModelLen, executor, head, vllm, ray), which "
        "deployments replace.",
    )
    router: RouterConfig = Field(
        default_factory=RouterConfig, description="One endpoint for every deployment (vllm-router)."
    )
    edge: EdgeConfig = Field(
        default_factory=EdgeConfig, description="The endpoint's gate (HAProxy): keys and routes checked first."
    )
    promote_from: Optional[StackName] = Field(
        None, description="Stack whose validated release (image digest, model, engine settings) this stack deploys."
    )
    promote_fingerprint: Optional[
        Annotated[str, matching(r"[0-9a-f]{16}", "a release fingerprint (16 hex digits)")]
    ] = Field(
        None,
        description="With promoteFrom: deploy only the release with this fingerprint (the one reviewed).",
    )
    api_key: Optional[ClientKey] = Field(
        None,
        description="Secret. A key clients send (`Authorization: Bearer <key>`), at least 16 characters; the edge "
        "knows its client as `default`.",
    )
    api_keys: dict[ClientName, ClientKey] = Field(
        default_factory=dict,
        description="Secret. More keys, one per client by name (`pulumi config set --secret --path apiKeys.alice …`): "
        "any of them (and apiKey) is accepted; the edge's log and its counter name the client, never the key. "
        "Adding, removing or replacing one reloads the edge only.",
    )
    tls: Optional[TlsConfig] = Field(
        None,
        description="Secret. The endpoint over HTTPS: the edge serves this certificate (`endpoint` becomes https://). "
        "Unset: plain HTTP.",
    )
    hf_token: Optional[TokenSecret] = Field(
        None, description="Secret. Hugging Face token (HF_TOKEN in the containers)."
    )
    grafana_admin_password: Optional[PasswordSecret] = Field(
        None, description="Secret. The password of Grafana's admin user, with metrics.grafanaNode."
    )
    ssh_private_key: Optional[PrivateKeySecret] = Field(
        None,
        description="Secret. SSH private key for every node, used by both transports. Default: the ssh-agent at "
        "SSH_AUTH_SOCK (~/.ssh/id_* alone is not enough: remote commands never read it).",
    )

    _executor_reason: Optional[str] = PrivateAttr(None)  # why executor auto chose what it did
    _replica: str = PrivateAttr("")  # a replica's view: its name (components/config/replicas.py view())

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_executor(cls, data: Any, handler: Any) -> ClusterConfig:
        """executor auto becomes ray or mp here (from the image), so every rule and renderer sees one of them."""
        data, reason = resolve_raw(data)
        model = handler(data)
        model._executor_reason = reason
        return model

    @property
    def executor_reason(self) -> Optional[str]:
        """With executor auto: which executor it chose and why (None when the config names one)."""
        return self._executor_reason

    def called(self, alone: str = "") -> str:
        """This replica's name; a single-model stack's is `alone` (its resources keep the names they had)."""
        return self._replica or alone

    def named(self, name: str, alone: str = "") -> str:
        """A name of this replica's (a resource, a container): `<replica>-<name>`; a single-model stack's is
        `name` as it always was (or `<alone>-<name>`)."""
        prefix = self.called(alone)
        return f"{prefix}-{name}" if prefix else name

    def said(self, line: str) -> str:
        """A log line of this replica's: `<replica>: <line>`; a single-model stack's as it is."""
        return f"{self._replica}: {line}" if self._replica else line

    @property
    def client_keys(self) -> dict[str, str]:
        """Every key a client may send, by the client's name: apiKey's as `default`, then apiKeys'."""
        found = {DEFAULT_CLIENT: self.api_key.get_secret_value()} if self.api_key is not None else {}
        return found | {name: key.get_secret_value() for name, key in sorted(self.api_keys.items())}

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

    def node_named(self, name: Optional[str]) -> Optional[NodeConfig]:
        return next((node for node in self.nodes if node.name == name), None)

    @property
    def endpoint_node(self) -> Optional[NodeConfig]:
        """Where the endpoint (the edge) is: the router's node, or the head; None where the config names a node it
        lacks (a rule says so)."""
        return self.node_named(self.router.node if self.router.enabled else (self.head or self.nodes[0].name))

    def url_on(self, name: Optional[str], port: int) -> Optional[str]:
        """http://<host>:<port> of the node `name` (its management address, where a user's browser goes)."""
        node = self.node_named(name)
        return None if node is None else f"http://{node.host}:{port}"

    @property
    def workers(self) -> list[NodeConfig]:
        return [node for node in self.nodes if node.name != self.head_node.name]

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def served_model_name(self) -> str:
        return self.vllm.served_model_name or (self.model or "")
