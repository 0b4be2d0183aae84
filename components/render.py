"""Pure renderers: validated config → argv lists, env lists, scripts and remote command lines.

Nothing here touches Pulumi or the network. Every value reaches a shell only through `shlex.join`
at the very edge (`shell_line`), so a hostile value stays one quoted word even if validation missed it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shlex
from importlib import resources
from typing import Any, Optional

from components.config import ClusterConfig, NodeConfig
from components.engine import EngineSettings
from components.names import (
    CONTAINER_PREFIX,
    GUARD_MARKER_IN_NODE,
    POLL_SECONDS,
    PROGRESS_SECONDS,
    RUN_DIR,
    SERVE_HANDOVER_SECONDS,
    SILENT_SECONDS,
    SMOKE_MAX_TOKENS,
    SMOKE_PROMPT,
    SMOKE_TIMEOUT_SECONDS,
    STATUS_FILE,
    SUPERVISOR_IN_CONTAINER,
    VLLM_LOG,
    VLLM_STOP_GRACE_SECONDS,
)
from components.scripts.node_contract import (
    AnswersParams,
    BenchmarkParams,
    ClusterWaitParams,
    HandoverParams,
    RayReady,
    ReadyParams,
    Recovery,
    SmokeParams,
    SupervisorParams,
    Tenancy,
    params_of,
    spec_fields,
)


def container_name(node: NodeConfig, prefix: str = "") -> str:
    """A node's container; with deployments, a replica's on that node (`prefix`: the replica's name)."""
    return f"{CONTAINER_PREFIX}-{prefix}-{node.name}" if prefix else f"{CONTAINER_PREFIX}-{node.name}"


def node_resource(cfg: ClusterConfig, node: NodeConfig, suffix: str) -> str:
    """A resource of `node` in `cfg` (a replica's view: prefixed with the replica's name)."""
    return cfg.named(f"{node.name}-{suffix}")


def node_rank(cfg: ClusterConfig, node: NodeConfig) -> int:
    """The head is rank 0; the workers follow in the order the config lists them."""
    return [cfg.head_node, *cfg.workers].index(node)


def ray_address(cfg: ClusterConfig) -> str:
    return f"{cfg.head_node.fabric_address}:{cfg.ray.port}"


def node_env(cfg: ClusterConfig, node: NodeConfig) -> list[str]:
    """Env of a node's Ray container, as Docker's `KEY=VALUE` list (secrets are added by the caller).

    vLLM forwards VLLM_*/NCCL_*/UCX_* to Ray workers itself but never VLLM_HOST_IP, GLOO_*, TP_* or
    RAY_*, so every node's container carries all of them for its own fabric address.
    """
    interface = node.fabric_interface
    env = {
        "VLLM_HOST_IP": str(node.fabric_address),
        "NCCL_SOCKET_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
        "TP_SOCKET_IFNAME": interface,
        "UCX_NET_DEVICES": interface,
        "OMPI_MCA_btl_tcp_if_include": interface,
        # The raylet kills workers above 95 % memory; on GB10 CPU and GPU share it, so the monitor
        # would kill vLLM once the weights are loaded.
        "RAY_memory_monitor_refresh_ms": "0",
        "NCCL_IB_DISABLE": "1" if cfg.nccl.ib_disable else "0",
    }
    if node.rdma_devices:
        env["NCCL_IB_HCA"] = ",".join(node.rdma_devices)
    if cfg.nccl.debug:
        env["NCCL_DEBUG"] = cfg.nccl.debug
    if cfg.executor == "ray" and cfg.ray.auth == "token":
        env["RAY_AUTH_MODE"] = "token"
    if cfg.container.hf_endpoint:
        env["HF_ENDPOINT"] = cfg.container.hf_endpoint
    if cfg.downloads_once:
        # The copy source downloaded the repo and modelSync copied it: no node asks the Hub again.
        env["HF_HUB_OFFLINE"] = "1"
    return [f"{key}={value}" for key, value in env.items()]


def supervisor_params(cfg: ClusterConfig, node: NodeConfig) -> dict[str, Any]:
    """What a node's container is, for its supervisor (components/scripts/supervisor.py): the
    container's command. Only what changes the container itself belongs here; what vLLM is (its
    arguments, recovery, the cluster it waits for) comes from the serve step (`supervisor_spec`)."""
    return SupervisorParams(
        node=node.name,
        executor=cfg.executor,
        run_dir=RUN_DIR,
        ray_argv=["ray", *ray_start_args(cfg, node)] if cfg.executor == "ray" else None,
        stop_grace_seconds=VLLM_STOP_GRACE_SECONDS,
        guard_marker=GUARD_MARKER_IN_NODE if cfg.network.guard else None,
        metrics_port=cfg.metrics.node_port,
    ).to_json()


def tenancy(cfg: ClusterConfig, co_tenants: list[Any]) -> Optional[Tenancy]:
    """A replica's place on a node it shares with `co_tenants` (other replicas, as placement.co_tenants gives
    them): its name and how long it may hold the node's GPU turn (None: it shares nothing)."""
    if not co_tenants:
        return None
    return Tenancy(replica=cfg.name_prefix, turn_hold_seconds=cfg.vllm.ready_timeout_seconds)


def supervisor_spec(cfg: ClusterConfig, node: NodeConfig, shared: Optional[Tenancy] = None) -> dict[str, Any]:
    """The part of vLLM's settings for a node's supervisor besides argv and env (a VllmSpec's); `shared`: its
    tenancy where the node holds other replicas too."""
    is_head = node.name == cfg.head_node.name
    recovery = cfg.recovery
    ray_ready = None
    if cfg.executor == "ray" and is_head:
        ray_ready = RayReady(address=ray_address(cfg), nodes=len(cfg.nodes), gpus=cfg.world_size)
    return spec_fields(
        Recovery(
            max_restarts=recovery.max_restarts,
            window_seconds=recovery.window_seconds,
            backoff_seconds=recovery.backoff_seconds,
            max_backoff_seconds=recovery.max_backoff_seconds,
            gpu_wait_seconds=recovery.gpu_wait_seconds,
        ),
        # What vLLM asks of each GPU (or a GB10's unified memory) at start: the supervisor waits until it is
        # free, where nvidia-smi reads it (none in a container without GPUs: then vLLM's own check decides).
        gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
        health_url=f"http://{local_http_host(cfg)}:{cfg.vllm.port}/health" if is_head else None,
        ray_ready=ray_ready,
        oom_guard_mib=cfg.memory.os_reserve_gib * 1024 if cfg.memory.oom_guard else None,
        tenancy=shared,
    )


def ray_start_args(cfg: ClusterConfig, node: NodeConfig) -> list[str]:
    """`ray start` for one node; the head binds the GCS on its fabric address only."""
    ray = cfg.ray
    common = [
        "start",
        "--block",  # the container lives exactly as long as its Ray node
        f"--node-ip-address={node.fabric_address}",
        f"--num-gpus={node.gpus}",
        "--disable-usage-stats",  # no phone-home; saves seconds at start
        # The worker range explicit (the config checks it); the raylet's, object manager's and agents'
        # ports are Ray's random picks from the ephemeral range, which network.guard fences as a whole.
        f"--min-worker-port={ray.min_worker_port}",
        f"--max-worker-port={ray.max_worker_port}",
    ]
    if ray.metrics_export_port is not None:
        common.append(f"--metrics-export-port={ray.metrics_export_port}")
    if node.name != cfg.head_node.name:
        return [*common, f"--address={ray_address(cfg)}"]
    dashboard = (
        ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ray.dashboard_port}"]
        if ray.dashboard
        else ["--include-dashboard=false"]
    )
    # No --ray-client-server-port: `ray start` refuses it without the ray[client] extra (vLLM images
    # lack it); with the extra the client server takes Ray's fixed 10001, which the config knows.
    return [*common, "--head", f"--port={ray.port}", *dashboard]


def serve_argv(
    cfg: ClusterConfig,
    model: str,
    engine: EngineSettings | None = None,
    node: NodeConfig | None = None,
    max_num_seqs: int | None = None,
    kv_cache_bytes: int | None = None,
) -> list[str]:
    """`vllm serve …` for `node` (default: the head). `engine` overrides the engine settings of a
    promoted release. With executor mp every node runs one, with its rank; ranks above 0 headless.
    `max_num_seqs`: what the memory plan set for vllm.maxNumSeqs auto (a hybrid model's cache blocks);
    `kv_cache_bytes`: the KV cache the plan pinned for a replica that shares its GPU."""
    settings = EngineSettings.of(cfg) if engine is None else engine
    argv = [
        "vllm",
        "serve",
        model,
        f"--tensor-parallel-size={cfg.tensor_parallel_size}",
        f"--pipeline-parallel-size={cfg.pipeline_parallel_size}",
    ]
    if cfg.executor == "ray":
        # vLLM has no automatic fallback when the world spans nodes, and on one node it would not use
        # the Ray the container runs: Ray is named whenever it is the executor.
        argv.append("--distributed-executor-backend=ray")
    elif len(cfg.nodes) > 1:
        rank = node_rank(cfg, node or cfg.head_node)
        argv += [
            "--distributed-executor-backend=mp",
            f"--nnodes={len(cfg.nodes)}",
            f"--node-rank={rank}",
            f"--master-addr={cfg.head_node.fabric_address}",
            f"--master-port={cfg.vllm.master_port}",
        ]
        if rank > 0:
            argv.append("--headless")
    if settings.max_model_len is not None:
        argv.append(f"--max-model-len={settings.max_model_len}")
    argv += [
        f"--gpu-memory-utilization={cfg.vllm.gpu_memory_utilization}",
        f"--host={cfg.vllm.host}",
        f"--port={cfg.vllm.port}",
        f"--served-model-name={cfg.vllm.served_model_name or model}",
    ]
    if settings.trust_remote_code:
        argv.append("--trust-remote-code")
    if settings.reasoning_parser:
        argv.append(f"--reasoning-parser={settings.reasoning_parser}")
    if settings.tool_call_parser:
        argv.append(f"--tool-call-parser={settings.tool_call_parser}")
    if settings.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    seqs = cfg.vllm.max_num_seqs if isinstance(cfg.vllm.max_num_seqs, int) else max_num_seqs
    if seqs is not None:
        argv.append(f"--max-num-seqs={seqs}")
    if kv_cache_bytes is not None:
        # in bytes, not profiled: a neighbour on the GPU starting or stopping meanwhile cannot change it
        argv.append(f"--kv-cache-memory-bytes={kv_cache_bytes}")
    if settings.speculative is not None:
        argv += ["--speculative-config", settings.speculative.flag_value()]
    return argv + list(settings.extra_args)


def cluster_wait_params(cfg: ClusterConfig) -> dict[str, Any]:
    """ray_join.py on the head: every node alive in Ray and TP × PP GPUs, before vLLM is handed its settings."""
    return params_of(
        ClusterWaitParams,
        node=cfg.head_node.name,
        ray_address=ray_address(cfg),
        expected=[{"name": n.name, "fabric_address": str(n.fabric_address)} for n in cfg.nodes],
        gpus_needed=cfg.world_size,
        timeout_seconds=cfg.ray.join_timeout_seconds,
        poll_seconds=POLL_SECONDS,
        progress_seconds=PROGRESS_SECONDS,
    )


# What differs between nodes among the variables vLLM's Ray executor copies from the driver to every
# worker (vllm/ray/ray_env.py get_env_vars_to_copy: VLLM_*, NCCL_*, UCX_*, HF_* …; never VLLM_HOST_IP or
# CUDA_VISIBLE_DEVICES): copied, the head's interface and HCA names would override each worker's own.
# vLLM leaves out the names listed in VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json.
NODE_SPECIFIC_ENV = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES")
# Kept from the workers too: the API key. Only the API server checks it, and a worker hashes every VLLM_*
# variable it has into its torch.compile cache key and writes their raw values beside its compiled graphs
# (vllm/envs.py compile_factors, vllm/compilation/backends.py cache_key_factors.json): copied, the key would
# sit in plain text in every node's compile cache.
HEAD_ONLY_ENV = ("VLLM_API_KEY",)
VLLM_CONFIG_ROOT = f"{RUN_DIR}/vllm-config"


def handover_params(
    cfg: ClusterConfig, node: NodeConfig, argv: list[str], api_key: str | None, shared: Optional[Tenancy] = None
) -> dict[str, Any]:
    """serve_spec.py on `node`: vLLM's settings for its supervisor (the API key among them: secret); `shared`:
    its tenancy on a node it shares with other replicas."""
    env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(cfg.vllm.ready_timeout_seconds)}
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM reads it when --api-key is absent
    if cfg.executor == "ray":
        env["VLLM_CONFIG_ROOT"] = VLLM_CONFIG_ROOT  # where serve_spec.py writes the non-carry-over list
    spec = supervisor_spec(cfg, node, shared)
    params = HandoverParams(
        node=node.name,
        argv=argv,
        env=env,
        spec=spec,
        # A bumped restartGeneration is new settings too: the supervisor restarts vLLM.
        fingerprint=fingerprint([argv, env, spec, cfg.vllm.restart_generation]),
        run_dir=RUN_DIR,
        timeout_seconds=SERVE_HANDOVER_SECONDS,
        ray_non_carry_over=[*NODE_SPECIFIC_ENV, *HEAD_ONLY_ENV] if cfg.executor == "ray" else [],
    )
    return dataclasses.asdict(params)


def http_base(cfg: ClusterConfig) -> str:
    return f"http://{local_http_host(cfg)}:{cfg.vllm.port}"


def ready_params(cfg: ClusterConfig, served: str, api_key: str | None) -> dict[str, Any]:
    """wait_ready.py on the head: /health 200 and /v1/models listing `served`."""
    params = ReadyParams(
        base_url=http_base(cfg),
        model=served,
        api_key=api_key,
        timeout_seconds=cfg.vllm.ready_timeout_seconds,
        poll_seconds=POLL_SECONDS,
        progress_seconds=PROGRESS_SECONDS,
        silent_seconds=SILENT_SECONDS,
        log_file=VLLM_LOG,
        status_file=STATUS_FILE,
    )
    return dataclasses.asdict(params)


def smoke_params(cfg: ClusterConfig, served: str, api_key: str | None) -> dict[str, Any]:
    """smoke.py on the head: one short chat completion."""
    params = SmokeParams(
        base_url=http_base(cfg),
        model=served,
        api_key=api_key,
        prompt=SMOKE_PROMPT,
        max_tokens=SMOKE_MAX_TOKENS,
        timeout_seconds=SMOKE_TIMEOUT_SECONDS,
    )
    return dataclasses.asdict(params)


# The conversations whose greedy answers a release with vllm.speculative must give as the same model does
# without it. Short, answerable by any chat model, and one of two turns: its second request repeats the
# first turn and its answer, a prefix the server has cached (where upstream saw speculation and prefix
# caching give wrong answers on hybrid models: vLLM issues 43559, 47194).
VALIDATION_CONVERSATIONS = (
    {"id": "capital", "turns": ["What is the capital of France? Answer in one sentence."]},
    {"id": "count", "turns": ["Count from 1 to 20, separated by commas."]},
    {"id": "code", "turns": ["Write a Python function that returns the n-th Fibonacci number."]},
    {"id": "colours", "turns": ["Name the three primary colours of light.", "Which colour do the first two make?"]},
)
VALIDATION_MAX_TOKENS = 64


def answers_params(
    cfg: ClusterConfig, served: str, api_key: str | None, baseline: list | None = None
) -> dict[str, Any]:
    """node_answers.py on the head: the validation conversations, compared with `baseline` when given."""
    return params_of(
        AnswersParams,
        base_url=http_base(cfg),
        model=served,
        api_key=api_key,
        conversations=[dict(each) for each in VALIDATION_CONVERSATIONS],
        max_tokens=VALIDATION_MAX_TOKENS,
        timeout_seconds=SMOKE_TIMEOUT_SECONDS,
        baseline=baseline,
    )


def benchmark_params(cfg: ClusterConfig, served: str, model: str, api_key: str | None) -> dict[str, Any]:
    """node_benchmark.py on the head: the configured load against the served model (`model`: what vLLM
    loaded, the tokenizer `vllm bench serve` needs)."""
    bench = cfg.benchmark
    return params_of(
        BenchmarkParams,
        base_url=http_base(cfg),
        model=served,
        model_path=model,
        api_key=api_key,
        tool=bench.tool,
        concurrency=bench.concurrency,
        requests=bench.requests,
        prompt_tokens=bench.prompt_tokens,
        output_tokens=bench.output_tokens,
        max_errors=bench.max_errors,
        timeout_seconds=bench.timeout_seconds,
        trust_remote_code=cfg.vllm.trust_remote_code,
    )


def local_http_host(cfg: ClusterConfig) -> str:
    """Where the head node itself reaches vLLM: loopback unless vLLM is bound to one address."""
    return "127.0.0.1" if str(cfg.vllm.host) == "0.0.0.0" else str(cfg.vllm.host)


# Scripts that share code: what each needs is prepended to it (each still travels as one program).
SCRIPT_HELPERS = {
    "supervisor.py": (
        "node_contract.py",
        "node_gpu_turn.py",
        "node_processes.py",
        "node_gpus.py",
        "node_memory_waits.py",
        "node_metrics.py",
        "node_compile_cache.py",
        "node_vllm_output.py",
    ),
    "serve_spec.py": ("node_contract.py",),
    "wait_ready.py": ("node_contract.py",),
    "smoke.py": ("node_contract.py",),
    "node_answers.py": ("node_contract.py",),
    "model_fingerprint.py": ("vllm_weights.py",),
    "hf_download.py": ("node_contract.py", "vllm_weights.py", "node_common.py"),
    "ray_join.py": ("node_contract.py",),
    "node_benchmark.py": ("node_contract.py",),
    "router_keeper.py": ("router_front.py",),
    "nccl_bandwidth.py": ("node_contract.py",),
    "node_fabric_gate.py": ("node_contract.py",),
    "image_pull.py": ("docker_api.py", "node_common.py"),
    "node_fabric_copy.py": ("docker_api.py", "node_common.py", "node_copy_channel.py", "node_copy_tree.py"),
}


@functools.cache
def script(name: str) -> str:
    files = resources.files("components.scripts")
    return (
        "".join(files.joinpath(part).read_text() + "\n" for part in SCRIPT_HELPERS.get(name, ()))
        + files.joinpath(name).read_text()
    )


def script_program(name: str, params: dict[str, Any]) -> str:
    """A script from components/scripts with its parameters, ready to feed to `python3 -` on stdin.

    Parameters travel inside the program text on stdin, never in argv or the remote environment,
    so secrets (API key) stay out of `ps` and sshd does not need AcceptEnv.
    """
    return f"PARAMS = {json.dumps(json.dumps(params, sort_keys=True))}\n{script(name)}"


def script_chain(steps: list[tuple[str, dict[str, Any]]]) -> str:
    """Several scripts as one program for `python3 -` (one stdin, one `docker exec`): each runs in a
    namespace of its own with its parameters, in order, what it prints passed on; the first to exit with
    a failure ends the chain with its code. Last, one JSON line: {"chain": {script: its last JSON line}}."""
    programs = [(name, script_program(name, params)) for name, params in steps]
    return (
        "import contextlib, io, json, sys\n"
        f"STEPS = json.loads({json.dumps(json.dumps(programs))})\n"
        "results = {}\n"
        "for name, program in STEPS:\n"
        "    out = io.StringIO()\n"
        "    code = 0\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            exec(compile(program, name, 'exec'), {'__name__': '__main__'})\n"
        "    except SystemExit as stop:\n"
        "        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)\n"
        "    sys.stdout.write(out.getvalue())\n"
        "    sys.stdout.flush()\n"
        "    if code:\n"
        "        sys.exit(code)\n"
        "    lines = [line for line in out.getvalue().splitlines() if line.startswith('{')]\n"
        "    results[name] = json.loads(lines[-1]) if lines else None\n"
        "print(json.dumps({'chain': results}))\n"
    )


def exec_python(container: str, timeout_seconds: int | None = None) -> list[str]:
    """`docker exec -i CONTAINER python3 -`: runs the program given on stdin inside the container."""
    argv = ["docker", "exec", "-i", container, "python3", "-"]
    if timeout_seconds is not None:
        # pulumi-command has no timeout of its own; a hung session would hang `pulumi up`.
        argv = ["timeout", "--kill-after=10", str(timeout_seconds), *argv]
    return argv


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)


INSTALL_SUPERVISOR = (
    "import hashlib, os, sys\n"
    "path = {path!r}\n"
    "code = sys.stdin.read()\n"
    "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "with open(path + '.tmp', 'w') as handle:\n"
    "    handle.write(code)\n"
    "os.replace(path + '.tmp', path)\n"
    "print('supervisor ' + hashlib.sha256(code.encode()).hexdigest()[:12] + ' installed; it runs from the '\n"
    "      'next start of the container (its first, a restart, a reboot)')\n"
)


def install_supervisor_argv(container: str) -> list[str]:
    """`docker exec -i CONTAINER python3 -c …`: writes the supervisor (on stdin) where supervisor_boot.py finds it."""
    return ["docker", "exec", "-i", container, "python3", "-c", INSTALL_SUPERVISOR.format(path=SUPERVISOR_IN_CONTAINER)]


def with_log_tail_on_failure(command: list[str], node: NodeConfig, container: str, lines: int = 60) -> str:
    """Run `command` on a node; when it fails, name the node and show the tail of its Ray log."""
    quoted = shlex.quote(container)
    # Every value stays a separate quoted word: inside double quotes `$(…)` would still expand.
    banner = shell_line(["echo", f"--- node {node.name}: last {lines} lines of docker logs {container} ---"])
    return (
        f"{shell_line(command)} || {{ rc=$?; {banner} >&2; docker logs --tail {lines} {quoted} >&2 2>&1; exit $rc; }}"
    )


HEREDOC_MARKER = "SPARK_VLLM_SCRIPT_END"


def with_script(command: str, script_text: str) -> str:
    """`command` with a script on its stdin as a quoted heredoc (no expansion inside).

    The script travels inside the command itself, so create and delete work the same way
    (pulumi-command feeds `stdin` only where it is set) and nothing is copied to the host first.
    """
    if HEREDOC_MARKER in script_text:
        raise ValueError("script contains the heredoc marker")
    body = script_text if script_text.endswith("\n") else script_text + "\n"
    return f"{command} <<'{HEREDOC_MARKER}'\n{body}{HEREDOC_MARKER}"


def if_container_running(container: str, command: list[str]) -> str:
    """A delete that succeeds when the container is gone or stopped (then nothing runs in it to stop)."""
    quoted = shlex.quote(container)
    running = f"docker inspect --type container --format '{{{{.State.Running}}}}' {quoted} 2>/dev/null"
    return f'if [ "$({running})" = true ]; then {shell_line(command)}; fi'


def fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def docker_host_url(node: NodeConfig) -> str:
    port = "" if node.ssh_port == 22 else f":{node.ssh_port}"
    return f"ssh://{node.user}@{node.host}{port}"
