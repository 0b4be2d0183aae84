# What the program hands a node's scripts and what they hand back, typed once for both sides: components/plan/
# and components/resources/ build these (they import this file as a module) and the scripts read them (they
# import it too, and it travels with them: components/plan/programs.py). `Contract` is the one
# way between a contract class and its JSON, both sides: a field added here is a field both sides know, and a key
# one side does not know fails loudly (TypeError) instead of being read as missing. Standard library only
# (Python 3.7+, whatever the host or the image has), no side effects.
#
# A contract class is what `@dataclass(frozen=True)` makes of it (fields from the annotations, base classes' first,
# defaults and `field(default_factory=…)`, the same __init__, equality, hash, repr and frozenness), made here without
# the dataclasses module: every node program imports this file, and `dataclasses` (which imports `inspect`, 15 ms)
# and the ~60 classes' generated methods (each compiled on its own, 23 ms) were 32-43 ms of every start (Debian's
# Python 3.11, 2026-12-07). tests/unit/test_contract.py holds the behaviour to a frozen dataclass's.
import enum
import typing
from typing import Dict, List, Optional

_MISSING = object()


class FrozenInstanceError(AttributeError):
    """A contract's field assigned or deleted (as dataclasses.FrozenInstanceError)."""


class Field:
    """One field of a contract class: `name`, `type`, and its default or default factory (None: none)."""

    __slots__ = ("name", "type", "default", "default_factory")

    def __init__(self, name, kind, default=_MISSING, default_factory=None):
        self.name, self.type, self.default, self.default_factory = name, kind, default, default_factory

    def __repr__(self):
        return f"Field(name={self.name!r}, type={self.type!r})"


class _Spec:
    __slots__ = ("default", "default_factory")

    def __init__(self, default, default_factory):
        self.default, self.default_factory = default, default_factory


def field(default=_MISSING, default_factory=None):
    """A field's default (as dataclasses.field): a value, or a factory called for each instance."""
    if default is not _MISSING and default_factory is not None:
        raise ValueError("cannot specify both default and default_factory")
    return _Spec(default, default_factory)


def fields(class_or_instance):
    """The fields of a contract class or instance, in order (as dataclasses.fields)."""
    return class_or_instance.__contract_fields__


class Contract:
    """`to_json()`: the fields as JSON-ready data, nested contracts as theirs; a field named in the class's
    OMIT_NONE is left out while None (turning nothing on changes no program that carries it).
    `from_json(data)`: the contract back, a field typed as a contract, an Optional one, a list of them or a dict
    of them built from its type, an enum from its value; a key the class does not know, or one it needs missing:
    TypeError. `replace(**changes)`: a copy with those fields changed (as dataclasses.replace)."""

    OMIT_NONE = ()
    __contract_fields__ = ()

    def __init__(self, *args, **kwargs):
        own = self.__contract_fields__
        name = type(self).__qualname__
        if len(args) > len(own):
            required = sum(1 for item in own if item.default is _MISSING and item.default_factory is None)
            takes = f"from {required + 1} to {len(own) + 1}" if required < len(own) else str(len(own) + 1)
            raise TypeError(f"{name}.__init__() takes {takes} positional arguments but {len(args) + 1} were given")
        values = {item.name: value for item, value in zip(own, args)}
        known = {item.name for item in own}
        for key, value in kwargs.items():
            if key not in known:
                raise TypeError(f"{name}.__init__() got an unexpected keyword argument {key!r}")
            if key in values:
                raise TypeError(f"{name}.__init__() got multiple values for argument {key!r}")
            values[key] = value
        missing = []
        for item in own:
            if item.name in values:
                value = values[item.name]
            elif item.default_factory is not None:
                value = item.default_factory()
            elif item.default is not _MISSING:
                value = item.default
            else:
                missing.append(item.name)
                continue
            object.__setattr__(self, item.name, value)
        if missing:
            said = [repr(key) for key in missing]
            listed = " and ".join(said) if len(said) < 3 else ", ".join(said[:-1]) + ", and " + said[-1]
            raise TypeError(
                "{}.__init__() missing {} required positional argument{}: {}".format(
                    name, len(missing), "s" if len(missing) > 1 else "", listed
                )
            )

    def __setattr__(self, key, value):
        raise FrozenInstanceError(f"cannot assign to field {key!r}")

    def __delattr__(self, key):
        raise FrozenInstanceError(f"cannot delete field {key!r}")

    def _values(self):
        return tuple(getattr(self, item.name) for item in self.__contract_fields__)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self):
        return hash(self._values())

    def __repr__(self):
        shown = ", ".join(f"{item.name}={getattr(self, item.name)!r}" for item in self.__contract_fields__)
        return f"{type(self).__qualname__}({shown})"

    def replace(self, **changes):
        values = {item.name: getattr(self, item.name) for item in self.__contract_fields__}
        values.update(changes)
        return type(self)(**values)

    def to_json(self):
        data = {}
        for item in self.__contract_fields__:
            value = getattr(self, item.name)
            if value is None and item.name in self.OMIT_NONE:
                continue
            data[item.name] = _plain(value)
        return data

    @classmethod
    def from_json(cls, data):
        types = {item.name: item.type for item in cls.__contract_fields__}
        return cls(**{key: _typed(types.get(key), value) for key, value in dict(data).items()})


def contract(cls):
    """A contract class: its fields those of its contract bases, in order, then its own annotations (one named again
    keeps its place), each with its default; a field without one after a field with one: TypeError, as
    `@dataclass` says."""
    found = {}
    for base in reversed(cls.__mro__[1:]):
        for item in base.__dict__.get("__contract_fields__", ()):
            found[item.name] = item
    for key, kind in cls.__dict__.get("__annotations__", {}).items():
        default = cls.__dict__.get(key, _MISSING)
        if isinstance(default, _Spec):
            found[key] = Field(key, kind, default.default, default.default_factory)
            if default.default is _MISSING:
                delattr(cls, key)
            else:
                setattr(cls, key, default.default)
        else:
            found[key] = Field(key, kind, default)
    seen_default = None
    for item in found.values():
        if item.default is not _MISSING or item.default_factory is not None:
            seen_default = item.name
        elif seen_default is not None:
            raise TypeError(f"non-default argument {item.name!r} follows default argument")
    cls.__contract_fields__ = tuple(found.values())
    return cls


def _plain(value):
    if isinstance(value, Contract):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _is_contract(kind):
    return isinstance(kind, type) and issubclass(kind, Contract)


def _typed(kind, value):
    """`value` (JSON) as `kind` wants it: contracts built, everything else as it is."""
    if value is None or kind is None or isinstance(value, Contract):
        return value
    origin, args = getattr(kind, "__origin__", None), getattr(kind, "__args__", None) or ()
    if origin is typing.Union:  # Optional[X]
        return _typed(next(arg for arg in args if arg is not type(None)), value)
    if origin is list and args and _is_contract(args[0]):
        return [args[0].from_json(item) for item in value]
    if origin is dict and len(args) == 2 and _is_contract(args[1]):
        return {key: args[1].from_json(item) for key, item in value.items()}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(value)  # a value it does not name: ValueError
    return kind.from_json(value) if _is_contract(kind) else value


def params_of(cls, **fields) -> dict:
    """What a script is handed: `cls`'s fields as JSON-ready data, through the dataclasses both ways (a field
    unknown or missing, here or in a nested contract given as a dict: TypeError)."""
    return cls.from_json(fields).to_json()


# --- a node's container and its vLLM ---------------------------------------------------------------------


@contract
class SupervisorParams(Contract):
    """What the container is (its command: a change replaces the container, so only what must)."""

    node: str
    executor: str  # "ray" or "mp"
    run_dir: str
    ray_argv: Optional[list]  # `ray start …` for this node with Ray; None with mp
    stop_grace_seconds: float
    guard_marker: Optional[str] = None  # with network.guard: the marker its container writes once its rules hold
    metrics_port: Optional[int] = None  # metrics.nodePort: the node's metrics on its fabric address
    gpu_turn_dir: Optional[str] = None  # the node's GPU turn (node_gpu_turn.py): its volume, in the container

    OMIT_NONE = (
        "guard_marker",
        "metrics_port",
        "gpu_turn_dir",
    )  # only when set: turning nothing on changes no container


@contract
class Recovery(Contract):
    """The stack's `recovery` keys (their defaults are the config's: components/config/sections.py)."""

    max_restarts: int
    window_seconds: float
    backoff_seconds: float
    max_backoff_seconds: float
    gpu_wait_seconds: float


@contract
class RayReady(Contract):
    """The Ray head's wait before vLLM: every node alive and the GPUs TP × PP needs."""

    address: str
    nodes: int
    gpus: int


@contract
class Tenancy(Contract):
    """A replica on a node it shares with other replicas: its name (what its neighbours are told) and how long it
    may hold the node's GPU turn (node_gpu_turn.py). Who the neighbours are is asked on the node itself, so a
    replica added beside it changes nothing here."""

    replica: str
    turn_hold_seconds: float  # vllm.readyTimeoutSeconds: a start that takes longer gives the turn back


@contract
class Watch(Contract):
    """RUN_DIR/watch.json: what the supervisor watches while vLLM serves (node_vllm_watch.py), handed over beside
    spec.json (HandoverParams' watch), not in it: a supervisor from before it reads spec.json as it always did,
    and changing it restarts nothing. The stack's vllm.stallSeconds and vllm.canarySeconds on the API server's
    node; on a headless rank, the API server's /health (a rank whose head went away is ended with it)."""

    stall_seconds: float  # requests running and none of vLLM's progress counters moved this long: stalled
    canary_seconds: float  # how often an idle vLLM is asked its canary (0: never); the name it asks: vLLM's argv
    head_health_url: Optional[str] = None  # a headless rank: its API server's /health

    OMIT_NONE = ("head_health_url",)


@contract
class Served(Contract):
    """What vLLM is on this node besides its argv, env and fingerprint: what the serve step renders (HandoverParams'
    spec), the supervisor's recovery and waits."""

    recovery: Recovery
    gpu_memory_utilization: Optional[float]  # what vLLM asks of each GPU at start; None without GPUs
    health_url: Optional[str]  # on the API server's node
    ray_ready: Optional[RayReady]  # on the Ray head
    oom_guard_mib: Optional[float] = None  # memory.oomGuard: vLLM is ended when MemAvailable falls under this
    tenancy: Optional[Tenancy] = None  # with deployments: who this is on the node, and who else is there

    # only when set: turning memory.oomGuard off restarts no vLLM, a single-model stack's spec stays as it was
    OMIT_NONE = ("oom_guard_mib", "tenancy")


@contract
class VllmSpec(Served):
    """RUN_DIR/spec.json: what vLLM is on this node, handed over by the serve step (serve_spec.py writes all of
    it: argv, env and fingerprint beside Served's fields; the file is mode 600, the API key is in env)."""

    argv: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    fingerprint: str = ""


@contract
class HandoverParams(Contract):
    """serve_spec.py on a node: vLLM's settings for its supervisor (the API key in env: a secret)."""

    node: str
    argv: list
    env: dict
    spec: Served
    fingerprint: str
    run_dir: str
    timeout_seconds: float
    ray_non_carry_over: list = field(default_factory=list)  # with Ray: env vars a worker must not inherit
    watch: Optional[Watch] = None  # RUN_DIR/watch.json beside spec.json (not in its fingerprint)

    OMIT_NONE = ("watch",)


@contract
class ReadyParams(Contract):
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


@contract
class SmokeParams(Contract):
    """smoke.py on the API node: one short chat completion (to vLLM, or through the endpoint: with `tls`, its
    certificate verified with `tls_ca` for `server_name`)."""

    base_url: str
    model: str
    prompt: str
    max_tokens: int
    timeout_seconds: float
    api_key: Optional[str] = None
    tls_ca: Optional[str] = None
    server_name: Optional[str] = None
    # through the endpoint: first, at most this long, until the edge's /health says 200 (it answers from its checks)
    wait_served_seconds: Optional[float] = None

    # only through the endpoint: the smoke test's own is as it was
    OMIT_NONE = ("tls_ca", "server_name", "wait_served_seconds")


@contract
class AnswersParams(Contract):
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


@contract
class ClusterWaitParams(Contract):
    """ray_join.py on the Ray head: every node alive in Ray and the GPUs TP × PP needs."""

    node: str
    ray_address: str
    expected: list  # [{"name", "fabric_address"}]
    gpus_needed: int
    timeout_seconds: float
    poll_seconds: float
    progress_seconds: float


@contract
class BenchmarkParams(Contract):
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
    measuring_file: Optional[str] = None  # holds the benchmark's pid while it measures: no canary meanwhile

    OMIT_NONE = ("measuring_file",)


@contract
class NcclParams(Contract):
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


@contract
class FabricPeer(Contract):
    name: str
    address: str  # its fabric address


@contract
class BandwidthTest(Contract):
    """fabric.bandwidthTest on one node: streams to `targets`, a listener for the peers it `expect`s."""

    port: int
    seconds: float
    streams: int
    targets: list  # the peers this node measures towards
    expect: list  # the peers that measure towards this node
    wait_seconds: float


@contract
class FabricGateParams(Contract):
    """node_fabric_gate.py on a node's host: the fabric's facts, the peers, the TCP test."""

    node: str
    interface: str
    address: str
    peers: List[FabricPeer]
    rdma_root: str
    bandwidth: Optional[BandwidthTest] = None


@contract
class LinkFacts(Contract):
    """The fabric interface as /sys/class/net and `ip addr` show it."""

    exists: bool
    present: Optional[list] = None  # when it does not exist: the interfaces the node has
    operstate: Optional[str] = None
    up: Optional[bool] = None  # IFF_UP
    carrier: Optional[int] = None  # unreadable while the interface is down
    mtu: Optional[int] = None
    speed_mbps: Optional[int] = None  # None when unknown (the link is down)
    addresses: list = field(default_factory=list)  # its IPv4 addresses

    OMIT_NONE = ("present",)


@contract
class RdmaPort(Contract):
    """One port of an RDMA device (/sys/class/infiniband)."""

    device: str
    port: int
    state: str  # ACTIVE, DOWN, …
    link_layer: Optional[str]  # Ethernet (RoCE) or InfiniBand
    netdev: Optional[str]  # the network device it sits on
    rocev2_gid_index: Optional[int]  # the RoCE v2 GID of the node's fabric address, if the kernel listed one


@contract
class PeerPath(Contract):
    """What a node saw of the way to one peer: the route, a ping, a full-size packet."""

    address: str
    route_dev: Optional[str] = None
    route_error: Optional[str] = None
    reach: Optional[bool] = None  # None: no ping on the node
    full_size: Optional[bool] = None
    full_size_said: Optional[str] = None

    OMIT_NONE = ("route_error", "reach", "full_size", "full_size_said")


@contract
class StreamResult(Contract):
    """The bandwidth test towards one peer: its figures, or why there are none."""

    gbps: Optional[float] = None
    bytes: Optional[int] = None
    seconds: Optional[float] = None
    streams: Optional[int] = None
    error: Optional[str] = None  # the test failed
    skipped: Optional[str] = None  # the peer did not answer over the fabric: not measured

    OMIT_NONE = ("gbps", "bytes", "seconds", "streams", "error", "skipped")


@contract
class FabricFacts(Contract):
    """What node_fabric_gate.py prints, its last line; `error` is the program's own, when it printed nothing
    readable."""

    node: str = ""
    interface: LinkFacts = field(default_factory=lambda: LinkFacts(exists=False))
    address_on: list = field(default_factory=list)  # the interfaces that hold the fabric address
    rdma: List[RdmaPort] = field(default_factory=list)
    listen_error: Optional[str] = None  # the bandwidth test's listener could not bind
    ping: bool = False  # ping is installed
    peers: Dict[str, PeerPath] = field(default_factory=dict)
    bandwidth: Optional[Dict[str, StreamResult]] = None  # with the bandwidth test: towards each target
    served: Optional[list] = None  # the peers that measured towards this node
    not_served: Optional[list] = None  # the expected peers that did not
    seconds: Optional[float] = None
    error: Optional[str] = None

    OMIT_NONE = ("listen_error", "bandwidth", "served", "not_served", "error")


@contract
class NcclFacts(Contract):
    """What nccl_bandwidth.py prints (its last line): how far it got, the network NCCL chose, the timing; or
    `error` (the program's own too, when the test printed nothing readable)."""

    node: str = ""
    rank: Optional[int] = None
    world: Optional[int] = None
    network: Optional[str] = None  # "IB" (RDMA, RoCE too) or "Socket", from NCCL's INFO log
    devices: dict = field(default_factory=dict)  # per network, the devices NCCL lists
    transports: list = field(default_factory=list)  # "via P2P/…", "via NET/…"
    torch: Optional[str] = None
    nccl: Optional[str] = None  # NCCL's version, as torch has it
    import_seconds: Optional[float] = None
    init_seconds: Optional[float] = None
    correct: Optional[bool] = None  # the first all-reduce summed to the world size
    bytes: Optional[int] = None  # per all-reduce
    seconds: Optional[float] = None  # per all-reduce, the mean of `iterations`
    iterations: Optional[int] = None
    total_seconds: Optional[float] = None
    error: Optional[str] = None
    log_tail: Optional[list] = None  # with an error: NCCL's warnings and NET lines
    python: Optional[str] = None  # with an error

    OMIT_NONE = tuple(
        "torch nccl import_seconds init_seconds correct bytes seconds iterations error log_tail python".split()
    )


@contract
class HfDownloadParams(Contract):
    """hf_download.py on the copy source: a Hugging Face repo id into the host's cache directory."""

    node: str
    repo: str
    hf_home: str
    host_cache: str
    progress_seconds: float
    endpoint: Optional[str] = None
    token: Optional[str] = None


# --- a node's host: its network guard, its image, the copies over the fabric ------------------------------


@contract
class GuardApi(Contract):
    """network.apiSources: the API port(s) on the node open only to these networks."""

    sources: list
    port: Optional[int] = None  # a single-model stack's head: its one API server
    ports: Optional[list] = None  # every API server on the node, the router's too

    OMIT_NONE = ("port", "ports")


@contract
class GuardSpec(Contract):
    """What the rules on a node say (components/resources/guard.py guard_spec); its hash is the marker's."""

    peers: list  # the other nodes' fabric addresses
    interface: str  # the fabric interface they arrive on
    guarded: list  # [[first, last]] port ranges only the peers reach
    ephemeral: bool  # the kernel's ephemeral range too (NCCL, Gloo and torch listen there)
    public: list  # ports left open
    api: Optional[GuardApi]
    # [[port, [uid, …]]]: ports on loopback only these users' sockets may connect to (vllm-router's, whose admin
    # API has no authentication: its keeper and the edge alone)
    owned: Optional[list] = None

    OMIT_NONE = ("owned",)


@contract
class GuardParams(Contract):
    """node_guard.py, in the guard container or a one-off `docker run` of the node's image."""

    node: str
    action: str  # check, run, ready, remove, show
    spec: GuardSpec
    hash: str
    host_root: str  # where the host's /usr and /etc are mounted
    marker: str
    check_seconds: float
    timeout_seconds: float
    backend: Optional[str] = None  # show: nft or iptables (tests); otherwise the host's own

    OMIT_NONE = ("backend",)


@contract
class PullParams(Contract):
    """image_pull.py on a node's host: the image through the Docker Engine API, with progress."""

    node: str
    image: str  # a tag or name@sha256:…
    timeout_seconds: float
    progress_seconds: float


@contract
class CopyParams(Contract):
    """node_fabric_copy.py: who copies from whom over the fabric (the depot's address on the copy source)."""

    role: str  # serve (the depot), image or model (a receiver)
    node: str
    source: str
    address: str
    port: int


@contract
class DepotParams(CopyParams):
    """The depot on the copy source (its token from SPARK_VLLM_COPY_TOKEN, the container's environment)."""

    image_id: Optional[str]  # the image it serves, with imageTransfer.method copy
    model_dir: Optional[str]  # the model it serves, with modelSync


@contract
class ImageCopyParams(CopyParams):
    """A node receiving the source's image (secret: the token)."""

    token: str
    image_id: str
    reference: str  # the tag it gets on arrival
    progress_seconds: float


@contract
class ModelCopyParams(CopyParams):
    """A node receiving the source's model directory (secret: the token)."""

    token: str
    model_dir: str
    progress_seconds: float


COPY_ROLES = {"serve": DepotParams, "image": ImageCopyParams, "model": ModelCopyParams}


@contract
class RouterWorker(Contract):
    """A replica as the router's keeper declares it (components/resources/router.py worker)."""

    url: str
    model: str
    replica: str
    root: Optional[str] = None  # the model it loaded, as /v1/models says
    max_model_len: Optional[int] = None
    stall_seconds: Optional[float] = None  # its vllm.stallSeconds: the keeper takes a stalled one out

    OMIT_NONE = ("stall_seconds",)


@contract
class KeeperParams(Contract):
    """router_keeper.py's parameters every mode has: all the router container's program (mode serve) takes. Each
    step's mode has a class of its own (KEEPER_MODES), as the copy's roles do."""

    mode: str  # serve, ready, workers, drain, undrain, smoke
    host: str
    port: int
    inner_port: int
    metrics_host: str
    metrics_port: int
    policy: str
    version: str
    index_url: Optional[str]
    health_interval: float


@contract
class KeeperStepParams(KeeperParams):
    """Mode ready: until vllm-router answers, at most `timeout` seconds (as every step's)."""

    timeout: float


@contract
class KeeperWorkersParams(KeeperStepParams):
    """Mode workers: the replicas the router routes to, declared whole."""

    workers: List[RouterWorker]


@contract
class KeeperWorkerParams(KeeperStepParams):
    """Modes drain and undrain: one replica out of the router (its requests finished), or back in."""

    worker: RouterWorker


@contract
class KeeperSmokeParams(KeeperStepParams):
    """Mode smoke: one short chat per model through the stack's endpoint (with tls: its certificate verified with
    `tls_ca` for `server_name`, the endpoint's host)."""

    models: List[str]
    prompt: str
    max_tokens: int
    wait_served_seconds: float  # first, at most this long, until the edge's /health says 200
    api_key: Optional[str] = None  # secret
    tls_ca: Optional[str] = None
    server_name: Optional[str] = None

    OMIT_NONE = ("api_key", "tls_ca", "server_name")


KEEPER_MODES = {
    "serve": KeeperParams,
    "ready": KeeperStepParams,
    "workers": KeeperWorkersParams,
    "drain": KeeperWorkerParams,
    "undrain": KeeperWorkerParams,
    "smoke": KeeperSmokeParams,
}


class VllmState(str, enum.Enum):
    """The supervisor's `state` in RUN_DIR/status.json (SupervisorStatus.state), by name: what serve_spec.py,
    wait_ready.py, serve_stop.py, the node metrics, the GPU lane and the tests match. Its value is what status.json
    and an operator read (where several words); `str()` and f-strings give it too, on every Python."""

    UNKNOWN = "unknown"  # no status.json yet (a reader's own: the supervisor never writes it)
    WAITING_GUARD = "waiting for network.guard"
    NO_SETTINGS = "no settings"
    WAITING_RAY = "waiting for Ray"
    WAITING_TURN = "waiting for the GPU turn"
    WAITING_MEMORY = "waiting for GPU memory"
    STARTING = "starting"
    RUNNING = "running"
    STALLED = "stalled"  # serving stopped while /health answered: being ended (node_watch.py)
    WRONG = "wrong tokens"  # the canary's answer changed: being ended
    HEAD_GONE = "head gone"  # a headless rank whose API server went away: being ended
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self):  # f-strings follow it too (Python 3.12 formats an enum by its str())
        return self.value


class Fault:
    """Why the supervisor ended a vLLM that had not exited (`last_fault.kind`, the faults metric's label)."""

    STALLED = "stalled"
    WRONG = "wrong"
    HEAD_GONE = "head_gone"
    ALL = (STALLED, WRONG, HEAD_GONE)


@contract
class LastExit(Contract):
    """How vLLM last exited (status.json's `last_exit`): its code, when (UTC), the reason read from its log."""

    code: Optional[int]
    at: str
    error: str


@contract
class LastFault(Contract):
    """What the supervisor saw when it last ended a vLLM that still answered /health (status.json's `last_fault`)."""

    kind: str  # a Fault
    at: str
    detail: str
    metrics: Optional[dict] = None  # vLLM's counters at the last look (and the API server's load)
    canary: Optional[dict] = None  # wrong tokens: where the canary's answer differed, and the answer


@contract
class SupervisorStatus(Contract):
    """RUN_DIR/status.json, rewritten by the supervisor on every change; read by serve_spec.py, wait_ready.py,
    serve_stop.py, statusCommand and the diagnostics bundle."""

    node: str
    executor: str
    state: VllmState
    spec_fingerprint: Optional[str] = None
    vllm_pid: Optional[int] = None
    serving: bool = False  # /health answers 200 (the API server's node)
    restarts_in_window: int = 0
    restarts_total: int = 0
    last_exit: Optional[LastExit] = None
    failed: Optional[str] = None  # why the supervisor gave up
    gpu_busy: Optional[str] = None
    ray_restarts: Optional[int] = None
    oom_guarded: int = 0
    turn: Optional[str] = None  # "held", or "waiting: held by …"
    faults: dict = field(default_factory=dict)  # Fault kind -> times vLLM was ended for it
    last_fault: Optional[LastFault] = None
    updated: Optional[str] = None
    summary: Optional[str] = None  # summarize()'s lines as the supervisor wrote them: what statusCommand prints

    def summarize(self):
        """What the status command prints of a node's vLLM: its state, serving, restarts and last exit, then why
        it gave up, what it waits for or the GPU turn; a second line for the last fault it ended vLLM for."""
        exit_ = self.last_exit
        if self.failed:
            why = "; GAVE UP: " + self.failed
        elif self.gpu_busy:
            why = "; waiting: " + self.gpu_busy
        elif self.turn:
            why = "; GPU turn: " + self.turn
        else:
            why = ""
        lines = [
            f"vLLM: {self.state}, serving: {'yes' if self.serving else 'no'}, restarts: {self.restarts_total} "
            f"({self.restarts_in_window} in the window), last exit: {exit_.code if exit_ else '-'} "
            f"{exit_.error if exit_ else ''}" + why
        ]
        fault = self.last_fault
        if fault:
            lines.append(f"last ended while /health answered: {fault.kind} at {fault.at}: {fault.detail}")
        return "\n".join(lines)

    @classmethod
    def read(cls, path):
        """The status a supervisor wrote at `path`, or None (none yet, or half written)."""
        import json

        try:
            with open(path) as handle:
                return cls.from_json(json.load(handle))
        except (OSError, ValueError, TypeError):
            return None


# --- what the checks read of a node: the model, the image, the memory ---------------------------------------


@contract
class ModelFingerprint(Contract):
    """What model_fingerprint.py prints of a model directory; `fingerprint` hashes files, metadata and broken."""

    fingerprint: Optional[str] = None  # None: nothing read (no directory to read, or `error`)
    files: dict = field(default_factory=dict)  # path -> size
    metadata: dict = field(default_factory=dict)  # path -> sha256 of the small files (config, tokenizer, index)
    broken: list = field(default_factory=list)  # symlinks that lead nowhere
    config: dict = field(default_factory=dict)  # config.json's keys the memory plan and the checks read
    weights: Optional[list] = None  # the weight files vLLM loads (vllm_weights.py); older fingerprints lack it
    error: Optional[str] = None  # the program's own: the step printed nothing readable

    OMIT_NONE = ("fingerprint", "weights", "error")


@contract
class ImageFacts(Contract):
    """What image_probe.py prints of the node's image (run in it, no network)."""

    python: Optional[str] = None
    vllm: Optional[str] = None  # its version; None: no vLLM
    vllm_nnodes: Optional[bool] = None  # whether vLLM has --nnodes (executor mp across nodes)
    vllm_load_tracking: Optional[bool] = None  # whether vLLM has --enable-server-load-tracking (the program sets it)
    vllm_scale_out: Optional[bool] = None  # whether vLLM has --enable-scale-out (its render routes need it: 0.30 on)
    ray: Optional[str] = None
    ray_dashboard: Optional[bool] = None  # whether `ray start --include-dashboard` can import its packages
    ray_dashboard_error: Optional[str] = None
    bytecode: dict = field(default_factory=dict)  # vllm, torch -> whether most of their sources have bytecode
    dont_write_bytecode: bool = False  # the image runs Python with PYTHONDONTWRITEBYTECODE
    torch: Optional[str] = None  # torch's version; None: no torch
    torch_cuda: Optional[str] = None  # the CUDA torch was built for (torch/version.py `cuda`): what the driver must run
    torch_arch: Optional[list] = None  # the GPU code torch carries (torch._C._cuda_getArchFlags: sm_90, compute_120 …)
    nccl: Optional[str] = None  # the NCCL the image's torch loads (the nvidia-nccl-cu* package's version)

    OMIT_NONE = ("ray_dashboard_error",)


@contract
class HostGpu(Contract):
    name: str
    compute_cap: Optional[str] = None  # "12.1" on a GB10 (nvidia-smi's compute_cap)


@contract
class HostFacts(Contract):
    """What host_facts.py prints of a node's host (over SSH, not in a container); None where the host cannot say."""

    kernel: Optional[str] = None
    os: Optional[str] = None
    driver: Optional[str] = None  # the NVIDIA driver, "580.95.05"
    cuda: Optional[str] = None  # the highest CUDA the driver supports, "13.0" (nvidia-smi's header)
    gpus: Optional[List[HostGpu]] = None
    docker_runtimes: Optional[list] = None
    cdi_nvidia: Optional[bool] = None
    toolkit: Optional[str] = None  # the NVIDIA Container Toolkit's version
    rdma_core: Optional[str] = None
    nic_firmware: Optional[str] = None  # the fabric interface's firmware (`ethtool -i`)


@contract
class NodeMemoryFacts(Contract):
    """The last line preflight_node.sh prints (a shell script: it writes this JSON with printf)."""

    mem_total_bytes: int = 0
    mem_available_bytes: Optional[int] = None
    gpu_memory_mib: list = field(default_factory=list)  # per GPU, where nvidia-smi reports it ([N/A] on a GB10)
    gpu_free_mib: list = field(default_factory=list)
    stack_running: bool = False  # the stack's own container runs: its vLLM holds memory, not judged


# --- what the serving steps print (their last line) -----------------------------------------------------------


@contract
class HandoverResult(Contract):
    """serve_spec.py: the settings handed over, and the vLLM they run in (None: not (yet) running)."""

    vllm_pid: Optional[int]
    fingerprint: str


@contract
class ReadyResult(Contract):
    """wait_ready.py: /health answered and /v1/models listed the model after this long."""

    ready_seconds: float


@contract
class ClusterSeen(Contract):
    """ray_join.py: the Ray nodes alive (their fabric addresses) and the GPUs they hold."""

    alive: list
    gpus: float


@contract
class SmokeResult(Contract):
    """smoke.py: one chat completion."""

    latency_seconds: float
    completion_tokens: int
    prompt_tokens: int
    generated_in: str  # content, reasoning, reasoning_content, or tokens (a reasoning model cut at max_tokens)


# The answers and the benchmark's figures are spelled as the release record keeps them (camelCase): the record
# holds what the scripts printed, and a release made by an earlier version reads the same.


@contract
class Answer(Contract):
    """One greedy answer of node_answers.py."""

    id: str  # conversation#turn
    tokenIds: Optional[list]  # noqa: N815 - the record's spelling
    text: str
    finishReason: Optional[str]  # noqa: N815


@contract
class Agreement(Contract):
    """The answers against the baseline's (the same model and engine without speculation)."""

    compared: int
    agreed: int
    differing: list  # [{"id", "at", "what", "text", "baselineText"}], the first difference of each


@contract
class AnswersResult(Contract):
    answers: List[Answer]
    agreement: Optional[Agreement] = None  # with a baseline

    OMIT_NONE = ("agreement",)


@contract
class BenchmarkFigures(Contract):
    """node_benchmark.py: the load's figures (latencies in ms as {"p50", "p99"})."""

    tool: str  # "vllm bench serve" or "spark-vllm" (its own load)
    durationSeconds: float  # noqa: N815 - the record's spelling
    completed: int
    errors: int
    errorSamples: list  # noqa: N815
    outputTokens: int  # noqa: N815
    outputTokensPerSecond: float  # noqa: N815
    requestsPerSecond: float  # noqa: N815
    ttftMs: dict  # noqa: N815
    itlMs: dict  # noqa: N815
    tpotMs: dict  # noqa: N815
    settings: dict  # concurrency, requests, promptTokens, outputTokens
    warmup: Optional[str] = None  # its own load: how the warm-up request went
    speculative: Optional[dict] = None  # with speculation: vLLM's spec_decode counters over the run

    OMIT_NONE = ("warmup", "speculative")


# --- what the copies and the router's keeper print ------------------------------------------------------------


@contract
class HfDownloaded(Contract):
    """hf_download.py: the repo in the host's cache."""

    repo: str
    revision: str
    snapshot: str  # its directory on the host
    files: int
    bytes: int
    downloaded_bytes: int
    seconds: float


@contract
class ImageCopied(Contract):
    """node_fabric_copy.py as an image receiver: the image id now on this node (nothing copied: it was here)."""

    image_id: str
    copied_bytes: int


@contract
class ModelCopied(Contract):
    """node_fabric_copy.py as a model receiver: what it copied, what it removed, how long deciding took."""

    copied_bytes: int
    files: int
    removed: int
    decided_seconds: float


@contract
class KeeperResult(Contract):
    """router_keeper.py's steps: what the router routes to now, by mode."""

    router: Optional[str] = None  # the stack's endpoint (ready, smoke)
    workers: Optional[dict] = None  # url -> model the router routes to (ready, workers)
    drained: Optional[list] = None  # the replicas held out (workers, drain, undrain)
    models: Optional[dict] = None  # smoke: model -> its answer's figures
    mode: Optional[str] = None  # drain, undrain
    worker: Optional[str] = None  # drain, undrain: its url

    OMIT_NONE = ("router", "workers", "drained", "models", "mode", "worker")
