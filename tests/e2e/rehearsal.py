"""The rehearsal: the real program applied to simulated nodes on this machine, end to end.

    sudo ./rehearse                  # 2 nodes: deploy (HTTPS, named keys), the openai client, destroy; stage times
    sudo ./rehearse --nodes 3 --pp   # 3 nodes, pipeline parallel
    sudo ./rehearse --fleet          # several models on 3 nodes behind one endpoint, a real openai client
    sudo ./rehearse --keep           # leave the cluster up to explore …
    sudo ./rehearse teardown         # … and remove it afterwards

It runs what the README tells a user to run — `pulumi login`, `pulumi stack init`, `pulumi config
set --secret …`, `pulumi preview --diff`, `pulumi up`, the openai client over HTTPS, `pulumi destroy` — with the
real Pulumi CLI, engine, Python language host and provider plugins (pulumi-command, pulumi-docker; built
from source by scripts/toolchain.sh; tests/e2e/cli_stack.py) on simulated nodes: each a network namespace with
its own sshd and dockerd (tests/e2e/nodes.py), pulling from a registry on the host. The image is built
locally with a real Ray and a stand-in for vLLM (tests/e2e/image, tests/e2e/standin). No GPU, no weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from tests.e2e import nodes as simnodes
from tests.e2e.cache import CACHE_DIR
from tests.e2e.cli_stack import RehearsalStack, Run, cli_missing
from tests.e2e.image.build import haproxy_ref, publish, registry_image_id
from tests.e2e.image.build import image_ref as image_name
from tests.e2e.image.dockerd import private_dockerd

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKDIR = ROOT / ".rehearsal"
# A tiny model's config.json: what the memory plan reads (layers, heads, head size), no weights.
MODEL_CONFIG = {
    "architectures": ["StandinForCausalLM"],
    "model_type": "standin",
    "max_position_embeddings": 8192,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
}


# A short benchmark after the smoke test: 8 requests, 2 at a time, 32 prompt and 16 output tokens each.
BENCHMARK = {"enabled": True, "concurrency": 2, "requests": 8, "promptTokens": 32, "outputTokens": 16}


def make_model(workdir: Path, name: str = "tiny-chat", **config: Any) -> Path:
    """A model directory like a real one (config.json, tokenizer files), minus the weights; `config`: keys
    of its config.json besides MODEL_CONFIG's (mtp_num_hidden_layers=1: a checkpoint with its MTP head)."""
    model = workdir / "models" / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**MODEL_CONFIG, **config}))
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    return model


def sandbox_ulimits() -> dict[str, int]:
    """The production defaults, capped at what this machine's hard limits allow."""
    import resource

    def cap(limit: int, wanted: int) -> int:
        hard = resource.getrlimit(limit)[1]
        if hard == resource.RLIM_INFINITY:
            return wanted
        return hard if wanted == -1 else min(wanted, hard)

    return {
        "memlock": cap(resource.RLIMIT_MEMLOCK, -1),
        "stack": cap(resource.RLIMIT_STACK, 67108864),
        "nofile": cap(resource.RLIMIT_NOFILE, 1048576),
    }


def edge_image(cluster: simnodes.SimCluster) -> str:
    """The edge's image in the cluster's registry: Debian's HAProxy, laid out as the official `haproxy` image,
    FROM the rehearsal image (both published there once, through a daemon of its own, so no node's images are
    touched: a module may hold the rehearsal image on one node only, under its local tag)."""
    registry = cluster.registry.address
    ref = haproxy_ref(CACHE_DIR, f"{registry}/{image_name()}")
    if not registry_image_id(registry, ref.split("/", 1)[1]):
        with private_dockerd("edge-", config={"insecure-registries": [registry]}) as host:
            publish(CACHE_DIR, registry, host)
    return ref


def rehearsal_config(
    cluster: simnodes.SimCluster,
    image_ref: str,
    model: Path,
    *,
    pipeline_parallel: bool = False,
    pin_host_keys: bool = True,
    key_secret: bool = True,
    tls: bool = False,
    **overrides: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stack config and secrets for the simulated nodes: management and fabric addresses differ, as on Sparks.

    The staging/prod way by default (host keys pinned and required, the SSH key as a secret); the dev
    way with `pin_host_keys=False` (trust on first use) and `key_secret=False` (an ssh-agent).
    """
    count = len(cluster.nodes)
    config: dict[str, Any] = {
        "nodes": [
            {
                "name": node.name,
                "host": node.mgmt_ip,
                "user": "root",
                "fabricAddress": node.fabric_ip,
                "fabricInterface": node.fabric_interface,
                # an RDMA device named on the head only (NCCL over IB is off: the simulated links have none)
                **({"rdmaDevices": ["rocep1s0f1"]} if node.index == 1 else {}),
                **({"hostKey": node.host_key} if pin_host_keys else {}),
            }
            for node in cluster.nodes
        ],
        "image": image_ref,
        "model": str(model),
        "tensorParallelSize": 1 if pipeline_parallel else count,
        "pipelineParallelSize": count if pipeline_parallel else 1,
        "maxModelLen": 4096,
        # CPU-only hosts (Ray still declares --num-gpus); limits within this sandbox's hard limits,
        # which root cannot raise here (no CAP_SYS_RESOURCE).
        "container": {"gpus": False, "ulimits": sandbox_ulimits()},
        "ray": {"dashboard": False, "joinTimeoutSeconds": 120},
        "nccl": {"ibDisable": True},
        # Half of this machine's memory: the memory plan leaves the rest to the OS (memory.osReserveGib).
        "vllm": {"port": 8000, "readyTimeoutSeconds": 180, "gpuMemoryUtilization": 0.5},
        "security": {"requireHostKeys": pin_host_keys},
        # the attack tables (tests/attacks.py) send thousands of refused requests from this machine's one address in
        # seconds: past edge.keylessPerSource its connections would be closed unanswered, and the table would test
        # the limit rather than the routes. The limits at their defaults: test_*_under_load (edge_under_load).
        "edge": {"image": edge_image(cluster), "keylessPerSource": ATTACK_TABLE_ALLOWANCE},
    }
    config.update(overrides)
    values = {"apiKey": "sk-rehearsal-" + secrets.token_hex(12), "hfToken": "hf_rehearsal_" + secrets.token_hex(12)}
    if key_secret:
        values["sshPrivateKey"] = cluster.client_key_private
    if tls:  # the endpoint over HTTPS (the head's), two clients with keys of their own beside apiKey
        values["tls"] = endpoint_tls(cluster.nodes[0].mgmt_ip)
        values["apiKeys"] = client_keys()
    return config, values


STAGES = {
    "image on every node": lambda e: e.type.endswith("RemoteImage"),
    "node checks (fabric gate, preflight, model fingerprint, image, host)": lambda e: e.name.endswith(
        ("-fabric-gate", "-preflight", "-model-fingerprint", "-image-check", "-host-check", "-gpu-check")
    ),
    "Ray formation (containers → all nodes joined)": lambda e: e.name.endswith("-cluster-ready"),
    "vLLM start → ready": lambda e: e.name.endswith("-ready") and "cluster" not in e.name,
    "smoke test": lambda e: e.name.endswith("-smoke"),
}


def stage_times(run: Run) -> dict[str, Optional[float]]:
    """Seconds from the end of one stage to the end of the next (they add up to the deploy time),
    from the moments the engine reported each resource done."""
    started = min((e.started for e in run.resources.values()), default=0.0)
    result, previous = {}, started
    for stage, belongs in STAGES.items():
        ends = [e.finished for e in run.resources.values() if belongs(e) and e.finished is not None]
        end = max(ends) if ends else None
        # A stage that ended before the one listed above it (checks beside a slow pull) added nothing.
        result[stage] = None if end is None else max(0.0, end - previous)
        previous = max(previous, end) if end is not None else previous
    return result


# The CAs the rehearsal's clients trust: each stack with `tls` gets a CA of its own (endpoint_tls), and every
# https:// request of the tests verifies the endpoint's certificate with them, as a user's client would.
TRUSTED: list[str] = []


def endpoint_tls(host: str) -> dict[str, str]:
    """The `tls` secret for an endpoint reached at `host`: a new CA's certificate for it, the CA trusted from now."""
    from tests.tls_ca import TestCa

    ca = TestCa("spark-vllm rehearsal CA")
    issued = ca.issue(host)
    TRUSTED.append(ca.pem)
    return {"certificate": issued.certificate, "key": issued.key, "ca": ca.pem}


def client_keys() -> dict[str, str]:
    """`apiKeys`: two clients, each with a key of its own."""
    return {name: f"sk-{name}-" + secrets.token_hex(16) for name in ("alice", "bob")}


def client_context() -> ssl.SSLContext:
    """What the tests' clients verify an https:// endpoint with: the CAs in TRUSTED, nothing else."""
    return ssl.create_default_context(cadata="".join(TRUSTED)) if TRUSTED else ssl.create_default_context()


def request(url: str, api_key: Optional[str] = None, body: Optional[dict] = None, timeout: float = 30) -> tuple:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    context = client_context() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None


def chat(endpoint: str, api_key: str, model: str) -> dict:
    status, answer = request(
        f"{endpoint}/chat/completions",
        api_key,
        {"model": model, "messages": [{"role": "user", "content": "hello from the rehearsal"}], "max_tokens": 16},
    )
    if status != 200:
        raise RuntimeError(f"chat completion failed: HTTP {status}")
    return answer


class Load:
    """Steady chat requests through the endpoint, from `threads` clients, streaming and not; every failure kept."""

    def __init__(self, endpoint, key, model, threads=4):
        self.endpoint, self.key, self.model = endpoint, key, model
        self.ok, self.failures, self.stop = 0, [], threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(n,), daemon=True) for n in range(threads)]

    def client(self, n):
        while not self.stop.is_set():
            body = {"model": self.model, "messages": [{"role": "user", "content": f"load {n} one two three"}],
                    "max_tokens": 8, "stream": n % 2 == 1}  # fmt: skip
            req = urllib.request.Request(self.endpoint + "/chat/completions", data=json.dumps(body).encode())
            req.add_header("Content-Type", "application/json")
            req.add_header("Authorization", f"Bearer {self.key}")
            try:
                with urllib.request.urlopen(req, timeout=60, context=client_context()) as response:
                    text = response.read().decode()
                done = '"finish_reason": "length"' in text or '"finish_reason": "stop"' in text
                with self.lock:
                    if response.status == 200 and done:
                        self.ok += 1
                    else:
                        self.failures.append(f"{response.status}: {text[-200:]}")
            except urllib.error.HTTPError as error:  # kept with what answered: the edge, vllm-router or vLLM
                said = error.read().decode(errors="replace")[-200:]
                with self.lock:
                    self.failures.append(f"{error.code} at {time.monotonic():.1f}: {said}")
            except (urllib.error.URLError, OSError, ValueError) as error:
                with self.lock:
                    self.failures.append(f"{error!r} at {time.monotonic():.1f}")

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_):
        self.stop.set()
        for thread in self.threads:
            thread.join(90)


def program_key(cluster: simnodes.SimCluster, node: simnodes.SimNode, container: str) -> str:
    """vLLM's key as the head's supervisor hands it over (/run/spark-vllm/spec.json): the program's own."""
    return json.loads(cluster.container_file(node, container, "/run/spark-vllm/spec.json"))["env"]["VLLM_API_KEY"]


def curl_chat(endpoint: str, api_key: str, model: str, ca_pem: Optional[str], scratch: Path) -> tuple[int, str]:
    """(curl's exit status, what it printed) for one chat completion as a user sends it: `--cacert` the CA (None:
    curl's own trust store), the key in a header file (never on curl's command line)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(dir=scratch) as where:
        header = Path(where) / "auth"
        header.write_text(f"Authorization: Bearer {api_key}\n")
        argv = [
            "curl",
            "-sS",
            "--max-time",
            "60",
            "-H",
            f"@{header}",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ]
        if ca_pem is not None:
            (Path(where) / "ca.pem").write_text(ca_pem)
            argv += ["--cacert", str(Path(where) / "ca.pem")]
        done = subprocess.run([*argv, f"{endpoint}/chat/completions"], capture_output=True, text=True, timeout=90)
    return done.returncode, done.stdout + done.stderr


def edge_requests(cluster: simnodes.SimCluster, node: simnodes.SimNode, port: int = 29003) -> dict[tuple, int]:
    """spark_vllm_edge_requests_total by (client, model), as Prometheus scrapes it on `node`'s fabric address."""
    probe = f"import urllib.request; print(urllib.request.urlopen('http://{node.fabric_ip}:{port}/metrics').read().decode())"
    text = cluster.run_in(cluster.nodes[-1], [sys.executable, "-c", probe]).stdout
    found = re.findall(r'^spark_vllm_edge_requests_total\{client="([^"]*)",model="([^"]*)"\} (\d+)$', text, re.M)
    return {(client, model): int(count) for client, model, count in found}


def compile_factors(cluster: simnodes.SimCluster, node: simnodes.SimNode) -> list[dict]:
    """The cache_key_factors.json files in the node's container: what vLLM 0.25 writes beside its compiled
    graphs, the raw values of the environment it hashed (tests/e2e/standin/vllm_standin/compile_cache.py)."""
    root = cluster.container_root(node, f"spark-vllm-{node.name}")
    paths = sorted(root.glob("root/.cache/vllm/torch_compile_cache/*/*/*/cache_key_factors.json"))
    text = "".join(path.read_text() for path in paths)
    found, decoder, at = [], json.JSONDecoder(), 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        value, at = decoder.raw_decode(text, at)
        found.append(value)
    return found


def compile_cache_keys(cluster: simnodes.SimCluster, node: simnodes.SimNode) -> set[str]:
    """The cache keys (directories) in the node's torch.compile cache: one per model and settings compiled."""
    listing = cluster.docker(
        node,
        "exec",
        f"spark-vllm-{node.name}",
        "sh",
        "-c",
        "ls /root/.cache/vllm/torch_compile_cache 2>/dev/null || true",
    ).stdout
    return set(listing.split())


def last_vllm_start(cluster: simnodes.SimCluster, node: simnodes.SimNode) -> str:
    """The node's vLLM log since the supervisor last started vLLM (its `=== spark-vllm: … vLLM started` line)."""
    log = cluster.docker(node, "exec", f"spark-vllm-{node.name}", "cat", "/run/spark-vllm/vllm.log").stdout
    starts = [m.start() for m in re.finditer(r"^=== spark-vllm: .* vLLM started", log, re.M)]
    return log[starts[-1] :] if starts else log


ATTACK_TABLE_ALLOWANCE = 1000000


@contextlib.contextmanager
def second_addresses(cluster: simnodes.SimCluster, count: int):
    """More addresses of this machine on the cluster's management bridge (.2, .3 …: the nodes are .11 and up), so
    that attackers and a client come from different addresses, as machines of the office network do."""
    prefix = cluster.host_mgmt_ip.rsplit(".", 1)[0]
    added = [f"{prefix}.{2 + n}" for n in range(count)]
    for address in added:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", cluster.mgmt_bridge], check=True)
    try:
        yield added
    finally:
        for address in added:
            subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", cluster.mgmt_bridge], check=False)


def edge_under_load(
    stack, cluster: simnodes.SimCluster, config: dict, secrets_: dict, target: Any, body: bytes
) -> dict:
    """The edge's limits at their defaults (edge.keylessPerSource back to its default: the edge's configuration
    alone changes), then each attack of tests/edge_load.py from one address of the management network while a
    keyed client chats from another. Returns the preview's changes and what each attack did."""
    from tests import edge_load

    limits = {**config, "edge": {key: value for key, value in config["edge"].items() if key != "keylessPerSource"}}
    stack.configure(limits, secrets_)
    preview = stack.preview()
    run = stack.up()
    with second_addresses(cluster, 1 + len(edge_load.attacks(0))) as (client, *attackers):
        found = edge_load.under_attacks(target, attackers, client, secrets_["apiKey"], body, slots=300, requests=10)
    return {"preview": preview, "run": run, "found": found}


def fleet_config(cluster: simnodes.SimCluster, image_ref: str, model: Path, **small_vllm) -> tuple[dict, dict]:
    """Several models on three simulated nodes (the example fleet's shape): `big` over node-1 and node-2 (TP 2),
    `side` on node-2 beside big's worker half, `small` twice on node-3 (two vLLMs sharing one GPU), the router on
    node-1."""
    config, secrets_ = rehearsal_config(cluster, image_ref, model)
    ray = config.pop("ray")
    for key in ("model", "tensorParallelSize", "pipelineParallelSize", "maxModelLen", "vllm"):
        config.pop(key, None)
    ready = {"readyTimeoutSeconds": 180}
    config["deployments"] = [
        {"name": "big", "model": str(model), "nodes": ["node-1", "node-2"], "tensorParallelSize": 2, "maxModelLen": 4096,
         "vllm": {"servedModelName": "big-model", "gpuMemoryUtilization": 0.4, **ready}, "ray": ray},
        {"name": "small", "model": str(model), "nodes": ["node-3"], "replicas": 2, "maxModelLen": 4096,
         "vllm": {"servedModelName": "small-model", "gpuMemoryUtilization": 0.3, **ready, **small_vllm}},
        {"name": "side", "model": str(model), "nodes": ["node-2"], "maxModelLen": 4096,
         "vllm": {"servedModelName": "side-model", "gpuMemoryUtilization": 0.3, "port": 8002, **ready}},
    ]  # fmt: skip
    config["router"] = {"port": 8080, "healthCheckIntervalSeconds": 2}
    # this machine's memory is the nodes' (about 24 GiB): a GB10's 8 GiB reserve would leave two vLLMs little
    config["memory"] = {"osReserveGib": 4}
    # the endpoint as it should be handed out: over TLS (the router's node), a key per client beside apiKey
    secrets_["tls"] = endpoint_tls(cluster.nodes[0].mgmt_ip)
    secrets_["apiKeys"] = client_keys()
    return config, secrets_


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def openai_client(endpoint: str, api_key: str):
    """The `openai` SDK's client of the endpoint, verifying an https:// one with the CAs in TRUSTED."""
    import httpx2 as httpx  # what openai 3.x is built on
    from openai import OpenAI

    http_client = httpx.Client(verify=client_context(), timeout=60) if endpoint.startswith("https://") else None
    return OpenAI(base_url=endpoint, api_key=api_key, max_retries=0, timeout=60, http_client=http_client)


def openai_tour(endpoint: str, api_key: str) -> dict:
    """What a real client (the `openai` SDK) gets through the endpoint: the models it lists, then for each a
    streamed chat and a tool call."""
    client = openai_client(endpoint, api_key)
    found: dict = {"models": sorted(model.id for model in client.models.list())}
    for model in found["models"]:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "say something"}], max_tokens=8, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        called = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the weather in Lyon?"}],
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        call = called.choices[0].message.tool_calls[0]
        found[model] = {"streamed": "".join(pieces), "chunks": len(pieces), "tool": call.function.name,
                        "arguments": json.loads(call.function.arguments)}  # fmt: skip
    return found


def _print_stages(title: str, run: Run) -> None:
    print(f"\n{title}")
    for stage, seconds in stage_times(run).items():
        print(f"  {stage:<48} {'-' if seconds is None else f'{seconds:6.1f} s'}")
    print(f"  {'pulumi up (engine and program start included)':<48} {run.seconds:6.1f} s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rehearse", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("action", nargs="?", choices=["run", "teardown"], default="run")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--pp", action="store_true", help="pipeline parallel across nodes instead of tensor parallel")
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="several models on three nodes, two of them sharing one GPU, behind one endpoint; ends with a real "
        "`openai` client's answers from each model",
    )
    parser.add_argument("--keep", action="store_true", help="leave the cluster up; `rehearse teardown` removes it")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)

    if args.action == "teardown":
        return teardown(args.workdir)
    problem = simnodes.skip_reason() or cli_missing()
    if problem:
        print(f"rehearse: cannot rehearse here: {problem}", file=sys.stderr)
        return 2
    if args.fleet:
        args.nodes = 3
    build_started = time.monotonic()
    # New simulated nodes: a state left by an earlier, interrupted run describes nodes that are gone.
    shutil.rmtree(args.workdir / "deployer", ignore_errors=True)
    cluster = simnodes.create_cluster(args.nodes, args.workdir / "nodes", registry_storage=CACHE_DIR / "registry")
    try:
        image = publish(CACHE_DIR, cluster.registry.address, cluster.nodes[0].docker_host)
        print(
            f"{args.nodes} simulated nodes and image {image.ref} ({'built' if image.built else 'cached'}, "
            f"in the cluster's registry) ready in {time.monotonic() - build_started:.1f} s"
        )
        stack = RehearsalStack(args.workdir / "deployer", "rehearsal", echo=print)
        if args.fleet:
            config, secret_values = fleet_config(cluster, image.ref, make_model(args.workdir))
        else:
            config, secret_values = rehearsal_config(
                cluster, image.ref, make_model(args.workdir), pipeline_parallel=args.pp, tls=True
            )
        _say("pulumi login && pulumi stack init rehearsal")
        stack.init()
        _say("pulumi config set --secret apiKey, apiKeys.alice/bob, tls.certificate/key/ca, hfToken, sshPrivateKey")
        stack.configure(config, secret_values)
        _say("pulumi preview --diff")
        stack.preview()
        _say("pulumi up --yes")
        run = stack.up(preview_first=True)
        endpoint = run.outputs["endpoint"]
        if args.fleet:
            _say(f"the openai client through {endpoint}: models.list(), then a streamed chat and a tool call each")
            tour = openai_tour(endpoint, secret_values["apiKeys"]["alice"])
            print(f"models: {tour.pop('models')}")
            for model, answers in tour.items():
                print(f"  {model:12} streamed {answers['streamed']!r} ({answers['chunks']} chunks); tool call "
                      f"{answers['tool']}({json.dumps(answers['arguments'])})")  # fmt: skip
            print("memory plans: " + "; ".join(
                f"{name} KV {plan.get('kvCache', {}).get('pinnedGib', 'profiled')} GiB"
                for name, plan in run.outputs["memoryPlan"].items()))  # fmt: skip
        else:
            _say(f"the openai client through {endpoint} (its certificate verified), as alice")
            tour = openai_tour(endpoint, secret_values["apiKeys"]["alice"])
            for model, answers in tour.items():
                if model != "models":
                    print(f"  {model}: streamed {answers['streamed']!r}; tool call {answers['tool']}")
        if "tls" in run.outputs:
            print(f"certificate served: {run.outputs['tls']}")
        _print_stages("deployed:", run)
        print(f"smoke test output: {run.outputs['smoke']}")
        v = stack.versions()
        print(f"ran: Pulumi CLI {v['pulumi']}, pulumi-language-python {v['pulumi-language-python']}, provider plugins "
              f"command {v['command']} and docker {v['docker']} (as each binary reports itself; scripts/toolchain.sh)")  # fmt: skip
        if args.keep:
            (args.workdir / "api-key").write_text(secret_values["apiKey"])
            (args.workdir / "ca.pem").write_text(secret_values["tls"]["ca"])
            print(f'\nkept up. Try:\n  curl -s --cacert {args.workdir}/ca.pem -H "Authorization: Bearer $(cat '
                  f'{args.workdir}/api-key)" {endpoint}/models')  # fmt: skip
            print(f"  ssh -F {cluster.ssh_config_path} root@{cluster.nodes[0].mgmt_ip} docker ps")
            print("remove it with: sudo ./rehearse teardown")
            return 0
        _say("pulumi destroy --yes")
        destroyed = stack.destroy(preview_first=True)
        print(f"destroyed in {destroyed.seconds:.1f} s")
        return 0
    finally:
        if not args.keep:
            cluster.close()


def _say(step: str) -> None:
    print(f"\n=== {step}", flush=True)


def teardown(workdir: Path) -> int:
    deployer = workdir / "deployer"
    if (deployer / "project").exists() and not cli_missing():
        try:
            RehearsalStack(deployer, "rehearsal", echo=print).destroy()
        except Exception as error:  # nodes may already be gone; removing them below still cleans up
            print(f"destroy: {error}", file=sys.stderr)
    removed = simnodes.cleanup_stale(force=True)
    shutil.rmtree(deployer, ignore_errors=True)
    print(f"removed simulated clusters: {removed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
