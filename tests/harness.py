"""Runs the real `__main__.py` under Pulumi's mocks and records everything it registers.

`RecordingMonitor` keeps what Pulumi's own MockMonitor drops on the floor — dependencies, parent,
provider, delete-before-replace, secret-ness of inputs — so tests can assert the resource graph,
and the rehearsal engine (tests/e2e) can carry each registration out for real.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import fcntl
import gc
import hashlib
import json
import os
import pickle
import runpy
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pulumi
from google.protobuf import json_format
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import resource as pulumi_resource
from pulumi.runtime import rpc, sync_await
from pulumi.runtime.proto import resource_pb2, source_pb2

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "spark-vllm"
CONTAINER = "docker:index/container:Container"
IMAGE = "docker:index/remoteImage:RemoteImage"
DOCKER_PROVIDER = "pulumi:providers:docker"
REMOTE_COMMAND = "command:remote:Command"
LOCAL_COMMAND = "command:local:Command"
SECRET_SIG = rpc._special_secret_sig  # the wire marker of a secret value
SIG_KEY = rpc._special_sig_key


@dataclass
class Registration:
    typ: str
    name: str
    urn: str
    parent: str
    provider: str
    custom: bool
    inputs: dict[str, Any]
    wire: dict[str, Any]  # inputs as sent, secrets still wrapped
    dependencies: list[str]
    delete_before_replace: bool
    additional_secret_outputs: list[str]
    replace_on_changes: list[str] = field(default_factory=list)
    property_dependencies: dict[str, list[str]] = field(default_factory=dict)  # input → the URNs it comes from
    id: Optional[str] = None
    outputs: dict[str, Any] = field(default_factory=dict)

    def secret_paths(self) -> list[str]:
        return sorted(_secret_paths(self.wire, ""))


def _secret_paths(value: Any, path: str) -> set[str]:
    if isinstance(value, dict):
        if value.get(SIG_KEY) == SECRET_SIG:
            return {path}
        return {p for k, v in value.items() for p in _secret_paths(v, f"{path}.{k}" if path else k)}
    if isinstance(value, list):
        return {p for i, v in enumerate(value) for p in _secret_paths(v, f"{path}[{i}]")}
    return set()


def reveal(value: Any) -> Any:
    """Inputs with secret wrappers removed: the values the provider would receive."""
    if isinstance(value, dict):
        if value.get(SIG_KEY) == SECRET_SIG:
            return reveal(value.get("value"))
        return {k: reveal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [reveal(v) for v in value]
    return value


def strip_secrets(value: Any) -> Any:
    """The wire form with every secret replaced by a marker: what would be stored in plain text."""
    if isinstance(value, dict):
        if value.get(SIG_KEY) == SECRET_SIG:
            return "[secret]"
        return {k: strip_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_secrets(v) for v in value]
    return value


class ExtendedArgs(pulumi_mocks.MockResourceArgs):
    registration: Registration


class RecordingMonitor(pulumi_mocks.MockMonitor):
    def __init__(self, mocks: pulumi.runtime.Mocks):
        super().__init__(mocks)
        self.registrations: list[Registration] = []
        self._lock = threading.Lock()

    def RegisterResource(self, request):  # noqa: N802 - the gRPC method name
        urn = self.make_urn(request.parent, request.type, request.name)
        if request.type == "pulumi:pulumi:Stack":
            return resource_pb2.RegisterResourceResponse(urn=urn)
        pulumi_mocks._ensure_event_loop()
        inputs = reveal(rpc.deserialize_properties(request.object, keep_internal=False))
        registration = Registration(
            typ=request.type,
            name=request.name,
            urn=urn,
            parent=request.parent,
            provider=request.provider,
            custom=request.custom or False,
            inputs=inputs,
            wire=json_format.MessageToDict(request.object),
            dependencies=list(request.dependencies),
            delete_before_replace=request.deleteBeforeReplace,
            additional_secret_outputs=list(request.additionalSecretOutputs),
            replace_on_changes=list(request.replaceOnChanges),
            property_dependencies={key: list(deps.urns) for key, deps in request.propertyDependencies.items()},
        )
        args = ExtendedArgs(
            typ=request.type,
            name=request.name,
            inputs=inputs,
            provider=request.provider,
            resource_id=request.importId,
            custom=request.custom or False,
        )
        args.registration = registration
        id_, state = self.mocks.new_resource(args)
        registration.id, registration.outputs = id_, state
        with self._lock:
            self.registrations.append(registration)
        # As the engine does: the outputs named in additionalSecretOutputs come back secret.
        returned = {k: ({SIG_KEY: SECRET_SIG, "value": v} if k in registration.additional_secret_outputs else v)
                    for k, v in state.items()}  # fmt: skip
        obj_proto = pulumi_mocks._sync_await(rpc.serialize_properties(returned, {}))
        self.resources[urn] = pulumi_mocks.MockMonitor.ResourceRegistration(urn, id_, state)
        return resource_pb2.RegisterResourceResponse(urn=urn, id=id_, object=obj_proto)


HF_CACHE = "/srv/hf"  # the container.hfCacheDir the program tests use
# vLLM's key, which the program makes once per stack (components/resources/cluster.py _program_key)
PROGRAM_KEY = "sk-spark-vllm-" + "p" * 43


def gate_params_of(create: str) -> dict[str, Any]:
    """The PARAMS a fabric gate command carries (script_program's first line)."""
    line = next(line for line in create.splitlines() if line.startswith("PARAMS = "))
    return json.loads(json.loads(line.removeprefix("PARAMS = ")))


class FakeCloud(pulumi.runtime.Mocks):
    """Answers like the providers would, without doing anything: ids and computed outputs."""

    memory_bytes = 125_000_000 * 1024  # a DGX Spark's unified memory, as /proc/meminfo says it
    # what image_probe.py says of a vLLM image with Ray and its dashboard (a test may change it)
    image_facts = {"python": "3.12.3", "vllm": "0.25.0", "vllm_nnodes": True, "vllm_load_tracking": True, "ray": "2.60.0",
                   "ray_dashboard": True, "torch": "2.11.0", "torch_cuda": "13.0",
                   "torch_arch": ["sm_100", "sm_120", "sm_75", "sm_80", "sm_86", "sm_90"], "nccl": "2.28.9"}  # fmt: skip
    # what host_facts.py says of a DGX Spark's host (its torch's list as torch 2.11.0+cu130 says it on the H100:
    # tests/gpu/results/2026-12-06/image-probe-h100.json)
    host_facts = {"kernel": "6.17.0-1032-nvidia", "os": "Ubuntu 24.04.3 LTS", "driver": "580.95.05", "cuda": "13.0",
                  "gpus": [{"name": "NVIDIA GB10", "compute_cap": "12.1"}], "docker_runtimes": ["nvidia", "runc"],
                  "cdi_nvidia": True, "toolkit": "1.18.0", "rdma_core": "50.0-2ubuntu0.2", "nic_firmware": "28.45.4028"}  # fmt: skip

    def __init__(self, stack_outputs: Optional[dict[str, dict[str, Any]]] = None):
        self.stack_outputs = stack_outputs or {}
        self.created: list[str] = []  # resource types, in registration order
        self.containers: list[str] = []  # the Docker names of the containers created

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        self.created.append(args.typ)
        if args.typ == "docker:index/container:Container":
            self.containers.append(args.inputs.get("name", ""))
        outputs = dict(args.inputs)
        if args.typ == "docker:index/remoteImage:RemoteImage":
            digest = "sha256:" + "ab" * 32
            outputs.update(image_id=digest, repo_digest=f"{args.inputs['name'].split(':')[0]}@{digest}")
        elif args.typ.startswith("command:"):
            stdout = {"ray-auth-token": "0f" * 32, "fabric-copy-token": "1e" * 32, "vllm-api-key": PROGRAM_KEY}.get(
                args.name, ""
            )
            if args.name.endswith("-model-fingerprint"):
                stdout = json.dumps(self.fingerprint(args.name.removesuffix("-model-fingerprint")))
            elif args.name.endswith("-preflight"):
                memory = json.dumps({"mem_total_bytes": self.memory_bytes, "gpu_memory_mib": ["[N/A]"]})
                stdout = f"preflight {args.name.removesuffix('-preflight')}: ok\n{memory}"
            elif args.name.endswith("-model-download"):
                stdout = json.dumps({"snapshot": f"{HF_CACHE}/hub/models--Qwen--Qwen3-0.6B/snapshots/{'c' * 40}"})
            elif args.name.endswith("-image-check"):
                stdout = json.dumps(self.image_facts)
            elif args.name.endswith("-host-check"):
                stdout = json.dumps(self.host_of(args.name.removesuffix("-host-check")))
            elif args.name.endswith("-fabric-gate") and "create" in args.inputs:
                stdout = json.dumps(self.fabric_facts(gate_params_of(args.inputs["create"])))
            elif args.name.endswith("-fabric-nccl") and "create" in args.inputs:
                stdout = json.dumps(self.nccl_facts(gate_params_of(args.inputs["create"])))
            elif args.name == "spark-vllm-router-smoke":
                stdout = json.dumps(self.router_smoke(args.inputs.get("stdin", "")))
            elif args.name.endswith("-smoke"):
                stdout = self.smoke_stdout(args.inputs.get("stdin", ""))
            elif args.name.endswith("-baseline"):
                stdout = json.dumps({"chain": {"wait_ready.py": {"ready_seconds": 3.0},
                                               "node_answers.py": {"answers": self.answers},
                                               "node_benchmark.py": self.baseline_figures}})  # fmt: skip
            elif args.name.endswith("-benchmark"):
                stdout = json.dumps(self.benchmark_figures(args.inputs.get("stdin", "")))
            outputs.update(stdout=stdout, stderr="")
        elif args.typ == "pulumi:pulumi:StackReference":
            stack = args.inputs["name"]
            outputs.update(outputs=self.stack_outputs.get(stack, {}), secretOutputNames=[])
        return f"{args.name}-id", outputs

    def host_of(self, node: str) -> dict[str, Any]:
        """host_facts.py's line for `node` (a test may give one node another host)."""
        return self.host_facts

    benchmark_output_tokens_per_second = 412.5
    # what node_answers.py prints of a start without speculation, and node_benchmark.py of its load
    answers = [{"id": "capital#1", "tokenIds": [11, 12, 13], "text": "Paris.", "finishReason": "stop"}]
    baseline_figures = {"tool": "spark-vllm", "durationSeconds": 19.8, "completed": 32, "errors": 0, "errorSamples": [],
                        "outputTokens": 4096, "outputTokensPerSecond": 206.25, "requestsPerSecond": 1.6,
                        "ttftMs": {"p50": 48.0, "p99": 91.5}, "itlMs": {"p50": 19.4, "p99": 21.0},
                        "tpotMs": {"p50": 19.4, "p99": 21.0},
                        "settings": {"concurrency": 4, "requests": 32, "promptTokens": 512, "outputTokens": 128}}  # fmt: skip

    def smoke_stdout(self, stdin: str) -> str:
        """smoke.py's line; with speculation the chain's, the answers agreeing with those the program passed."""
        smoke = {"latency_seconds": 0.5, "completion_tokens": 3, "prompt_tokens": 7, "generated_in": "content"}
        if "node_answers.py" not in stdin:
            return json.dumps(smoke)
        agreement = {"compared": len(self.answers), "agreed": len(self.answers), "differing": []}
        answers = {"answers": self.answers, "agreement": agreement}
        return json.dumps({"chain": {"smoke.py": smoke, "node_answers.py": answers}})

    def router_smoke(self, stdin: str) -> dict[str, Any]:
        """What router_keeper.py's smoke prints: each model answered through the endpoint."""
        params = json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1])) if stdin else {}
        models = params.get("models") or []
        return {"router": f"http://{params.get('host')}:{params.get('port')}",
                "models": {m: {"latencySeconds": 0.4, "completionTokens": 3, "answeredBy": m} for m in models}}  # fmt: skip

    def benchmark_figures(self, stdin: str) -> dict[str, Any]:
        """What node_benchmark.py prints for its PARAMS (the program's, read back from the command's stdin)."""
        params = json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1])) if stdin else {}
        return {
            "tool": "spark-vllm",
            "durationSeconds": 9.9,
            "completed": params.get("requests"),
            "errors": 0,
            "errorSamples": [],
            "outputTokens": 4096,
            "outputTokensPerSecond": self.benchmark_output_tokens_per_second,
            "requestsPerSecond": 3.2,
            "ttftMs": {"p50": 48.0, "p99": 91.5},
            "itlMs": {"p50": 9.1, "p99": 12.4},
            "tpotMs": {"p50": 9.6, "p99": 13.0},
            "settings": {"concurrency": params.get("concurrency"), "requests": params.get("requests"),
                         "promptTokens": params.get("prompt_tokens"), "outputTokens": params.get("output_tokens")},
        }  # fmt: skip

    def fabric_facts(self, params: dict[str, Any]) -> dict[str, Any]:
        """What node_fabric_gate.py reports of a good DGX Spark fabric: the interface up at 200 Gb/s with MTU
        9000, both RoCE twins ACTIVE (the fabric one with a RoCE v2 GID), every peer answering full-size
        packets, ~23 Gb/s to each target."""
        interface, address = params["interface"], params["address"]
        bandwidth = params.get("bandwidth") or {}
        return {
            "node": params["node"],
            "interface": {
                "exists": True,
                "operstate": "up",
                "up": True,
                "carrier": 1,
                "mtu": 9000,
                "speed_mbps": 200000,
                "addresses": [address],
            },  # fmt: skip
            "address_on": [interface],
            "rdma": [
                {
                    "device": "rocep1s0f1",
                    "port": 1,
                    "state": "ACTIVE",
                    "link_layer": "Ethernet",
                    "netdev": interface,
                    "rocev2_gid_index": 3,
                },  # fmt: skip
                {
                    "device": "roceP2p1s0f1",
                    "port": 1,
                    "state": "ACTIVE",
                    "link_layer": "Ethernet",
                    "netdev": "enP2p1s0f1np1",
                    "rocev2_gid_index": None,
                },  # fmt: skip
            ],
            "ping": True,
            "peers": {
                peer["name"]: {"address": peer["address"], "route_dev": interface, "reach": True, "full_size": True}
                for peer in params["peers"]
            },
            "bandwidth": {
                name: {"gbps": 23.5, "bytes": 2_937_500_000, "seconds": 1.0, "streams": 4}
                for name in bandwidth.get("targets", [])
            },  # fmt: skip
            "served": sorted(bandwidth.get("expect", [])),
            "not_served": [],
            "seconds": 1.4,
        }

    nccl_network = "IB"
    nccl_seconds = 0.0143  # per all-reduce of 256 MiB between two nodes: ~150 Gb/s of bus bandwidth

    def nccl_facts(self, params: dict[str, Any]) -> dict[str, Any]:
        """What nccl_bandwidth.py prints on a node of two good Sparks: NCCL over both RoCE twins."""
        return {
            "node": params["node"],
            "rank": params["rank"],
            "world": params["world"],
            "torch": "2.11.0+cu130",
            "nccl": "2.28.9",
            "init_seconds": 2.1,
            "correct": True,
            "network": self.nccl_network,
            "devices": {self.nccl_network: "[0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; OOB enp1s0f1np1"}
            if self.nccl_network == "IB"
            else {"Socket": "[0]enp1s0f1np1:192.168.200.12<0>"},
            "transports": [f"NET/{self.nccl_network}/0", f"NET/{self.nccl_network}/1"],
            "bytes": params["megabytes"] << 20,
            "seconds": self.nccl_seconds,
            "iterations": params["iterations"],
            "total_seconds": 6.5,
        }

    def fingerprint(self, node: str) -> dict[str, Any]:
        """What model_fingerprint.py prints for the same model on every node: the seed model's shape
        (Qwen3.5-122B-A10B-FP8, about 126 GB of weights)."""
        return {
            "fingerprint": "f" * 64,
            "files": {
                "config.json": 700,
                "model-00001-of-00002.safetensors": 63_000_000_000,
                "model-00002-of-00002.safetensors": 63_000_000_000,
            },  # fmt: skip
            "metadata": {"config.json": "c" * 64},
            "config": {
                "text_config": {
                    "num_hidden_layers": 48,
                    "num_attention_heads": 32,
                    "num_key_value_heads": 2,
                    "head_dim": 256,
                    "full_attention_interval": 4,
                    "max_position_embeddings": 262144,
                    "torch_dtype": "bfloat16",
                    "vocab_size": 248320,
                    "mtp_num_hidden_layers": 1,
                }  # fmt: skip
            },
        }

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}


@dataclass
class ProgramRun:
    registrations: list[Registration]
    exports: dict[str, Any]
    secret_exports: set[str] = field(default_factory=set)  # exported as Pulumi secrets

    def plain_exports(self) -> dict[str, Any]:
        """The stack outputs `pulumi stack output` shows without --show-secrets."""
        return {name: value for name, value in self.exports.items() if name not in self.secret_exports}

    def of_type(self, typ: str) -> list[Registration]:
        return [r for r in self.registrations if r.typ == typ]

    def named(self, name: str) -> Registration:
        matches = [r for r in self.registrations if r.name == name]
        assert len(matches) == 1, f"{name}: {len(matches)} registrations"
        return matches[0]

    def by_urn(self) -> dict[str, Registration]:
        return {r.urn: r for r in self.registrations}


def changed_inputs(before: ProgramRun, after: ProgramRun) -> dict[str, Any]:
    """Per custom resource whose inputs differ between two runs of the program: the set of input
    keys that changed, or "create" / "delete". What the engine then does (update or replace) is the
    provider's decision: the rehearsal observes it through the real engine (tests/e2e)."""
    first = {r.urn: r for r in before.registrations if r.custom}
    second = {r.urn: r for r in after.registrations if r.custom}
    result: dict[str, Any] = {}
    for urn in first.keys() | second.keys():
        name = urn.rsplit("::", 1)[1]
        if urn not in first:
            result[name] = "create"
        elif urn not in second:
            result[name] = "delete"
        else:
            old, new = first[urn].inputs, second[urn].inputs
            keys = {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
            if keys:
                result[name] = keys
    return result


def stack_config(values: dict[str, Any]) -> dict[str, str]:
    """Stack config the way Pulumi passes it: strings, structured values as JSON."""
    return {f"{PROJECT}:{key}": value if isinstance(value, str) else json.dumps(value) for key, value in values.items()}


async def settle(value: Any) -> tuple[Any, bool]:
    """An export's plain value, every Output in it resolved, and whether any of them is secret.

    Awaited directly, not through `Output.all`, which would build an Output for every key and item
    of the values (the fabric's and the memory plan's per-node dicts): work `pulumi up` does not do
    (it serializes the stack's outputs) and that benchmarks/program_scale.py would count as the
    program's."""
    if isinstance(value, pulumi.Output):
        inner, inner_secret = await settle(await value.future())
        return inner, inner_secret or await value.is_secret()
    if isinstance(value, (dict, list, tuple)):
        items = list(value.values()) if isinstance(value, dict) else list(value)
        settled = await asyncio.gather(*(settle(item) for item in items))
        plain = [item for item, _ in settled]
        is_secret = any(flag for _, flag in settled)
        return (dict(zip(value, plain, strict=True)) if isinstance(value, dict) else plain), is_secret
    return value, False


class InThisThread(concurrent.futures.ThreadPoolExecutor):
    """An executor whose work is done in the calling thread when it is submitted (asyncio's default executor must be a
    ThreadPoolExecutor; this one starts no thread)."""

    def submit(self, fn, /, *args, **kwargs):
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as error:  # as a pool's future holds it, for the awaiting side
            done.set_exception(error)
        return done


def run_program(
    config: dict[str, Any],
    secrets: Optional[dict[str, str]] = None,
    *,
    stack: str = "test",
    mocks: Optional[pulumi.runtime.Mocks] = None,
    on_exports: Optional[Callable[[dict], None]] = None,
    foreign: Optional[dict[str, str]] = None,
    quick: bool = True,
) -> ProgramRun:
    """The program under mocks with `config` and `secrets` in the project's namespace; `foreign`: full
    keys of other namespaces (`docker:host`, a misspelt `spark_vllm:model`). `quick`: the garbage collector off and
    the mocks answering in this thread, for tests (below); False runs the SDK as `pulumi up` has it run, for
    benchmarks/program_scale.py's timings."""
    secrets = secrets or {}
    monitor = RecordingMonitor(mocks or FakeCloud())
    pulumi.runtime.set_mocks(monitor.mocks, project=PROJECT, stack=stack, preview=False, monitor=monitor)
    pulumi.runtime.set_all_config(
        {**stack_config({**config, **secrets}), **(foreign or {})}, [f"{PROJECT}:{key}" for key in secrets]
    )
    exports: dict[str, Any] = {}
    resolved: dict[str, Any] = {}
    secret: set[str] = set()
    real_export = pulumi.export

    def capture(name: str, value: Any) -> None:
        exports[name] = value
        real_export(name, value)

    @pulumi.runtime.test
    def program():
        with mock.patch.object(pulumi, "export", capture):
            runpy.run_path(str(ROOT / "__main__.py"), run_name="__main__")

        async def collect() -> None:
            settled = await asyncio.gather(*(settle(value) for value in exports.values()))
            for name, (value, is_secret) in zip(exports, settled, strict=True):
                resolved[name] = value
                if is_secret:
                    secret.add(name)

        return pulumi.Output.from_input(asyncio.ensure_future(collect()))

    # Where in the program each resource was declared (a stack trace per registration, each frame's file made a
    # URI): the engine shows it, mocks never read it, and it took 15 % of a program run's time under them.
    collecting, loop = gc.isenabled(), sync_await._ensure_event_loop()
    pool = loop._default_executor
    if quick:
        # The garbage collector off while the program runs: a test process keeps what earlier tests left (runs shared
        # and compared, hundreds of MB), and each full collection the SDK's many short-lived objects set off walked
        # all of it (a program run alone in a fresh process: 0.29 -> 0.25 CPU-s; the fast lane's tests/program: 71.8
        # -> 53.1 CPU-s, 2026-12-07). What the run leaves in cycles is collected once the collector is on again.
        gc.disable()
        # The SDK hands each call of the monitor to a thread pool (a gRPC call under the engine); here the monitor is
        # the mocks, Python that answers at once, and each hand-off was thread switches for nothing: the mocks answer
        # in this thread (tests/program in one process, 74 -> 54 CPU-s, 2026-12-07).
        loop.set_default_executor(InThisThread())
    try:
        with mock.patch.object(pulumi_resource, "_get_stack_trace", source_pb2.StackTrace):
            program()
    finally:
        loop._default_executor = pool
        if collecting:
            gc.enable()
    if on_exports:
        on_exports(resolved)
    return ProgramRun(registrations=list(monitor.registrations), exports=resolved, secret_exports=secret)


_SHARED: dict[str, ProgramRun] = {}
_SHARED_HOME: list[str] = []
SHARED_RUNS_ENV = "SPARK_VLLM_SHARED_RUNS"  # a folder the test processes of one pytest session share (conftest.py)


def _shared_home() -> str:
    """The one SPARK_VLLM_HOME of every shared run: the session's (each xdist worker the same), else the process's."""
    if not _SHARED_HOME:
        folder = os.environ.get(SHARED_RUNS_ENV)
        if folder:
            home = os.path.join(folder, "home")
            os.makedirs(home, exist_ok=True)
        else:
            home = tempfile.mkdtemp(prefix="spark-vllm-shared-home-")
        _SHARED_HOME.append(home)
    return _SHARED_HOME[0]


def _across_processes(key: str, make: Callable[[], ProgramRun]) -> ProgramRun:
    """`make()` once a pytest session for `key`: the first process to ask runs it and leaves it pickled in the
    session's folder; another asking meanwhile waits on the key's lock and reads it (the fast lane's workers
    each ran prod's config, 2026-12-07). Without the session's folder (a test run alone): `make()`."""
    folder = os.environ.get(SHARED_RUNS_ENV)
    if not folder:
        return make()
    name = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32])
    with open(name + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(name + ".pickle", "rb") as handle:
                return pickle.load(handle)
        except FileNotFoundError:
            pass
        run = make()
        with open(name + ".tmp", "wb") as handle:
            pickle.dump(run, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(name + ".tmp", name + ".pickle")
        return run


def shared_run(
    config: dict[str, Any],
    secrets: Optional[dict[str, str]] = None,
    *,
    stack: str = "test",
    cloud: Optional[type[pulumi.runtime.Mocks]] = None,
    cached: bool = True,
) -> ProgramRun:
    """`run_program(config, secrets, stack=stack, mocks=cloud())` once a pytest session for the same inputs (a copy
    each time, so a test may change what it got), across its xdist workers too; `cloud` a class of mocks made with
    no arguments (FakeCloud by default). For tests that only read the run: one that patches the program's modules or
    the environment, or reads what the program logs, runs the program itself. The run with prod's config was 50 of
    the 195 runs of tests/program (21 of its 82 CPU seconds, 2026-12-06), the several-models stack's 9 (8.9 s).

    The program also reads SPARK_VLLM_HOME (where it writes the SSH key file, which the providers' SSH options
    name): every shared run has the session's one folder, where each test has its own, so a run to compare with a
    shared one is made there too (`cached=False`: the program runs, and the run is not kept). Whether an ssh-agent
    is set is part of the key."""
    home = _shared_home()
    cloud = cloud or FakeCloud
    key = json.dumps(
        [
            config,
            secrets or {},
            stack,
            f"{cloud.__module__}.{cloud.__qualname__}",
            bool(os.environ.get("SSH_AUTH_SOCK")),
        ],
        sort_keys=True,
    )
    if key in _SHARED and cached:
        return copy.deepcopy(_SHARED[key])

    def make() -> ProgramRun:
        with mock.patch.dict(os.environ, {"SPARK_VLLM_HOME": home}):
            return run_program(config, secrets, stack=stack, mocks=cloud())

    if not cached:
        return make()
    _SHARED[key] = _across_processes(key, make)
    return copy.deepcopy(_SHARED[key])
