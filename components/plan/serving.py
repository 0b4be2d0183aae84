"""What `vllm serve` is on each node: its argv, the handover's parameters, and the parameters of the steps that
follow it (readiness, smoke test, validation answers, benchmark)."""

from __future__ import annotations

from typing import Any, Optional

from components.config import ClusterConfig, NodeConfig
from components.plan.container import node_rank, supervisor_spec, watch_spec
from components.plan.edge import SEES_UPSTREAM_SECONDS
from components.plan.endpoint import edge_listen, edge_node, vllm_host, vllm_port, vllm_url
from components.plan.engine import EngineSettings
from components.plan.names import (
    MEASURING_FILE,
    POLL_SECONDS,
    PROGRESS_SECONDS,
    RUN_DIR,
    SERVE_HANDOVER_SECONDS,
    SILENT_SECONDS,
    SMOKE_MAX_TOKENS,
    SMOKE_PROMPT,
    SMOKE_TIMEOUT_SECONDS,
    STATUS_FILE,
    VLLM_LOG,
)
from components.plan.programs import as_configured
from components.plan.shell import fingerprint
from components.scripts.node_contract import (
    AnswersParams,
    BenchmarkParams,
    HandoverParams,
    ReadyParams,
    SmokeParams,
    Tenancy,
    params_of,
)


def serve_argv(
    cfg: ClusterConfig,
    model: str,
    engine: EngineSettings | None = None,
    node: NodeConfig | None = None,
    max_num_seqs: int | None = None,
    kv_cache_bytes: int | None = None,
    scale_out: bool = False,
) -> list[str]:
    """`vllm serve …` for `node` (default: the head). `engine` overrides the engine settings of a
    promoted release. With executor mp every node runs one, with its rank; ranks above 0 headless.
    `max_num_seqs`: what the memory plan set for vllm.maxNumSeqs auto (a hybrid model's cache blocks);
    `kv_cache_bytes`: the KV cache the plan pinned for a replica that shares its GPU; `scale_out`: the image's vLLM
    has --enable-scale-out (0.30 on), which a replica behind vllm-router's cache_aware policy then gets."""
    settings = EngineSettings.of(cfg) if engine is None else engine
    argv = [
        "vllm",
        "serve",
        model,
        f"--tensor-parallel-size={cfg.tensor_parallel_size}",
        f"--pipeline-parallel-size={cfg.pipeline_parallel_size}",
        *executor_args(cfg, node),
    ]
    if settings.max_model_len is not None:
        argv.append(f"--max-model-len={settings.max_model_len}")
    argv += [
        f"--gpu-memory-utilization={cfg.vllm.gpu_memory_utilization}",
        f"--host={vllm_host(cfg)}",
        f"--port={vllm_port(cfg)}",
        f"--served-model-name={cfg.vllm.served_model_name or model}",
        "--enable-server-load-tracking",  # /load: what the stall rule counts besides the engine's gauges
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
    if scale_out and cfg.router.enabled and cfg.router.policy == "cache_aware":
        # vllm-router 0.1.17's cache_aware asks each replica's /v1/chat/completions/render for the prompt's tokens
        # (src/backend/preprocess.rs http_kv_input); without the flag vLLM 0.30 on refuses it (403 from 0.32:
        # vllm/entrypoints/scale_out/factories.py), and the router routes by load alone ("missing_tokens")
        argv.append("--enable-scale-out")
    return argv + list(settings.extra_args)


def executor_args(cfg: ClusterConfig, node: NodeConfig | None = None) -> list[str]:
    """The executor's flags for `node` (default: the head): Ray named whenever it is the executor (vLLM has no
    automatic fallback when the world spans nodes, and on one node it would not use the Ray the container runs);
    with mp across nodes each node's rank, ranks above 0 headless."""
    if cfg.executor == "ray":
        return ["--distributed-executor-backend=ray"]
    if len(cfg.nodes) == 1:
        return []
    rank = node_rank(cfg, node or cfg.head_node)
    found = [
        "--distributed-executor-backend=mp",
        f"--nnodes={len(cfg.nodes)}",
        f"--node-rank={rank}",
        f"--master-addr={cfg.head_node.fabric_address}",
        f"--master-port={cfg.vllm.master_port}",
    ]
    return [*found, "--headless"] if rank > 0 else found


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
    return params_of(
        HandoverParams,
        node=node.name,
        argv=argv,
        env=env,
        spec=spec,
        # A bumped restartGeneration is new settings too: the supervisor restarts vLLM.
        fingerprint=fingerprint([argv, env, spec.to_json(), cfg.vllm.restart_generation]),
        run_dir=RUN_DIR,
        timeout_seconds=SERVE_HANDOVER_SECONDS,
        ray_non_carry_over=[*NODE_SPECIFIC_ENV, *HEAD_ONLY_ENV] if cfg.executor == "ray" else [],
        watch=watch_spec(cfg, node),
    )


def http_base(cfg: ClusterConfig) -> str:
    """vLLM's API server as the head's own steps reach it (readiness, smoke, answers, benchmark): directly."""
    return vllm_url(cfg)


def _at_endpoint(contract: type, cfg: ClusterConfig, served: str, api_key: str | None, **fields: Any) -> dict:
    """A head step's parameters: `contract` with the served model's endpoint (its base URL, name and key)."""
    return params_of(contract, base_url=http_base(cfg), model=served, api_key=api_key, **fields)


def ready_params(cfg: ClusterConfig, served: str, api_key: str | None) -> dict[str, Any]:
    """wait_ready.py on the head: /health 200 and /v1/models listing `served`."""
    waits = {"poll_seconds": POLL_SECONDS, "progress_seconds": PROGRESS_SECONDS, "silent_seconds": SILENT_SECONDS}
    return _at_endpoint(
        ReadyParams, cfg, served, api_key, timeout_seconds=cfg.vllm.ready_timeout_seconds, log_file=VLLM_LOG,
        status_file=STATUS_FILE, **waits,
    )  # fmt: skip


def endpoint_smoke_params(cfg: ClusterConfig, served: str, api_key: str | None) -> dict[str, Any]:
    """smoke.py on the head through the endpoint (without the router: the edge on this node), as a client sends it:
    with `tls` over HTTPS, the certificate verified with tls.ca for the endpoint's host; the program's own key; once
    the edge's /health says 200 (its checks have seen vLLM ready)."""
    host, port = edge_listen(cfg)
    reach = "127.0.0.1" if host == "0.0.0.0" else host
    tls = {"tls_ca": cfg.tls.ca, "server_name": edge_node(cfg).host} if cfg.tls is not None else {}
    return params_of(
        SmokeParams, base_url=f"{'https' if tls else 'http'}://{reach}:{port}", model=served, api_key=api_key,
        prompt=SMOKE_PROMPT, max_tokens=SMOKE_MAX_TOKENS, timeout_seconds=SMOKE_TIMEOUT_SECONDS,
        wait_served_seconds=SEES_UPSTREAM_SECONDS, **tls,
    )  # fmt: skip


def smoke_params(cfg: ClusterConfig, served: str, api_key: str | None) -> dict[str, Any]:
    """smoke.py on the head: one short chat completion."""
    return _at_endpoint(
        SmokeParams, cfg, served, api_key, prompt=SMOKE_PROMPT, max_tokens=SMOKE_MAX_TOKENS,
        timeout_seconds=SMOKE_TIMEOUT_SECONDS,
    )  # fmt: skip


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
    conversations = [dict(each) for each in VALIDATION_CONVERSATIONS]
    return _at_endpoint(
        AnswersParams, cfg, served, api_key, conversations=conversations, max_tokens=VALIDATION_MAX_TOKENS,
        timeout_seconds=SMOKE_TIMEOUT_SECONDS, baseline=baseline,
    )  # fmt: skip


def benchmark_params(cfg: ClusterConfig, served: str, model: str, api_key: str | None) -> dict[str, Any]:
    """node_benchmark.py on the head: the configured load (`benchmark`'s keys of the same names) against the
    served model (`model`: what vLLM loaded, the tokenizer `vllm bench serve` needs)."""
    load = as_configured(BenchmarkParams, cfg.benchmark)
    return _at_endpoint(
        BenchmarkParams, cfg, served, api_key, model_path=model, trust_remote_code=cfg.vllm.trust_remote_code,
        measuring_file=MEASURING_FILE, **load,
    )  # fmt: skip
