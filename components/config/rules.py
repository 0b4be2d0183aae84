"""The stack config's cross-field rules, each with the keys it reads (components/config/runner.py runs
them). A rule returns its problems, one line each: key path, value found, what is expected."""

from __future__ import annotations

import re
from typing import Any

from components.config import key_rules  # noqa: F401  (registers the keys' and the certificate's rules)
from components.config.deployment_rules import unreached
from components.config.errors import problem
from components.config.listeners import node_listeners
from components.config.node_rules import names_a_node  # registers the nodes' rules, first
from components.config.replicas import DEPLOYMENT_ROOTS, deployment_problems
from components.config.runner import rule, run
from components.config.vllm_args import read_extra_args


def run_rules(source: Any) -> list[str]:
    """Every rule that can run on `source` (a ClusterConfig or a partial view of one). With deployments,
    the rules of one model run on each replica's view instead (components/config/replicas.py); the deferred
    ones (components/config/deployment_rules.py) last, each line on a key not named already."""
    fleet = _has_deployments(source)
    stack_level = (lambda each: not _of_one_model(each)) if fleet else (lambda each: True)
    problems = run(source, only=lambda each: stack_level(each) and not each.deferred)
    if fleet:
        problems += deployment_problems(source, lambda replica: run(replica, only=_of_one_model))
    late = run(source, only=lambda each: stack_level(each) and each.deferred)
    keys = {line.split(": ")[0] for line in problems}
    return problems + [line for line in late if line.split(": ")[0] not in keys]


def _has_deployments(source: Any) -> bool:
    raw = getattr(source, "raw", None)
    if isinstance(raw, dict):
        return bool(raw.get("deployments"))
    return bool(getattr(source, "deployments", None))


def _of_deployments(each: Any) -> bool:
    """Whether a rule judges the deployments (components/config/deployment_rules.py)."""
    return any(key.startswith(("deployments[].", "deployments[*].")) for key in each.keys)


def _of_one_model(each: Any) -> bool:
    """Whether a rule reads a key that each deployment has its own of."""
    return any(re.split(r"[.\[]", key)[0] in DEPLOYMENT_ROOTS for key in each.keys)


def _head(cfg: Any) -> str:
    return cfg.head if cfg.head is not None else cfg.nodes[0].name


# --- what is served, and from where ------------------------------------------------------------------


def _set_or_promoted(cfg: Any, key: str, value: Any) -> list[str]:
    if cfg.promote_from is None and value is None:
        return [problem(key, None, "a value (or promoteFrom: a stack whose release to deploy)")]
    if cfg.promote_from is not None and value is not None:
        return [problem(key, value, f"no value: promoteFrom {cfg.promote_from!r} decides it (remove one of the two)")]
    return []


@rule("promoteFrom", "image")
def image_or_promotion(cfg: Any) -> list[str]:
    return _set_or_promoted(cfg, "image", cfg.image)


@rule("promoteFrom", "model")
def model_or_promotion(cfg: Any) -> list[str]:
    return _set_or_promoted(cfg, "model", cfg.model)


@rule("promoteFrom", "promoteFingerprint")
def fingerprint_with_promotion(cfg: Any) -> list[str]:
    if cfg.promote_fingerprint is not None and cfg.promote_from is None:
        return [problem("promoteFingerprint", cfg.promote_fingerprint, "promoteFrom beside it (or remove it)")]
    return []


@rule("promoteFrom", "release.minOutputTokensPerSecond", "release.maxP99TtftMs")
def floors_with_promotion(cfg: Any) -> list[str]:
    if cfg.promote_from is not None:
        return []
    floors = (("minOutputTokensPerSecond", cfg.release.min_output_tokens_per_second),
              ("maxP99TtftMs", cfg.release.max_p99_ttft_ms))  # fmt: skip
    return [
        problem(f"release.{key}", value, "promoteFrom beside it: a floor for the promoted release")
        for key, value in floors
        if value is not None
    ]


@rule("benchmark.enabled", "benchmark.promptTokens", "benchmark.outputTokens", "maxModelLen")
def benchmark_fits_the_context(cfg: Any) -> list[str]:
    bench = cfg.benchmark
    if not bench.enabled or cfg.max_model_len is None:
        return []
    total = bench.prompt_tokens + bench.output_tokens
    if total <= cfg.max_model_len:
        return []
    return [
        problem(
            "benchmark.promptTokens + benchmark.outputTokens",
            total,
            f"at most maxModelLen ({cfg.max_model_len}): vLLM refuses longer requests",
        )
    ]


@rule("metrics.prometheusNode", "nodes[].name")
def prometheus_runs_on_a_node(cfg: Any) -> list[str]:
    return names_a_node(cfg, "metrics.prometheusNode", cfg.metrics.prometheus_node)


@rule("metrics.grafanaNode", "metrics.prometheusNode", "grafanaAdminPassword", "nodes[].name")
def grafana_has_what_it_needs(cfg: Any) -> list[str]:
    """Grafana reads the stack's Prometheus, and its admin has a password of the stack's (a secret)."""
    wanted = cfg.metrics.grafana_node
    if wanted is None:
        return []
    problems = names_a_node(cfg, "metrics.grafanaNode", wanted)
    if cfg.metrics.prometheus_node is None:
        problems.append(problem("metrics.grafanaNode", wanted, "a Prometheus beside it: set metrics.prometheusNode"))
    if cfg.grafana_admin_password is None:
        problems.append(
            problem(
                "grafanaAdminPassword",
                None,
                "a secret with metrics.grafanaNode (`pulumi config set --secret grafanaAdminPassword …`): Grafana "
                "would otherwise keep its admin/admin",
            )
        )
    return problems


@rule("router.enabled", "router.node", "nodes[].name")
def router_runs_on_a_node(cfg: Any) -> list[str]:
    return names_a_node(cfg, "router.node", cfg.router.node) if cfg.router.enabled else []


@rule("router.enabled", "router.node", "nodes[].name", "nodes[].fabricAddress", "head", "vllm.host", deferred=True)
def router_reaches_vllm(cfg: Any) -> list[str]:
    """The router on another node than the head sends it every request: vLLM there must listen where the router
    reaches it. With deployments this runs on each replica's view (router.node among its nodes);
    deployment_rules.router_reaches_replicas judges the rest."""
    router = cfg.router
    home = next((node for node in cfg.nodes if node.name == router.node), None)
    head = _head(cfg)
    if not router.enabled or home is None or home.name == head:
        return []
    return unreached("vllm.host", cfg.vllm.host, f"vLLM on the head ({head})", home, "router.node")


@rule("metrics.prometheusNode", "nodes[].name", "head", "vllm.host")
def prometheus_reaches_vllm(cfg: Any) -> list[str]:
    """The metrics' Prometheus node reaches vLLM on the head (of each replica, with deployments: a
    Prometheus on a node the replica does not run on is checked by components/config/replicas.py). vLLM
    listens on the head's fabric address, which network.guard lets every node reach: network.apiSources
    limits the edge alone."""
    wanted = cfg.metrics.prometheus_node
    nodes = {node.name: node for node in cfg.nodes}
    if wanted is None or wanted not in nodes:
        return []
    node, head, problems = nodes[wanted], _head(cfg), []
    if node.name != head and cfg.vllm.host.is_loopback:
        problems.append(
            problem(
                "metrics.prometheusNode",
                node.name,
                f"the head ({head}): vLLM binds {cfg.vllm.host} (vllm.host), which only the head itself reaches",
            )
        )
    return problems


@rule("vllm.enableAutoToolChoice", "vllm.toolCallParser")
def tool_choice_has_a_parser(cfg: Any) -> list[str]:
    if cfg.vllm.enable_auto_tool_choice and cfg.vllm.tool_call_parser is None:
        return [
            problem("vllm.toolCallParser", None, "a parser (e.g. qwen3_coder) because enableAutoToolChoice is true")
        ]
    return []


@rule("vllm.host", "vllm.allowUnauthenticated", "apiKey", "apiKeys")
def a_public_bind_has_a_key(cfg: Any) -> list[str]:
    host = cfg.vllm.host
    if host.is_loopback or cfg.api_key is not None or cfg.api_keys or cfg.vllm.allow_unauthenticated:
        return []
    return [
        problem(
            "apiKey",
            None,
            f"a secret (`pulumi config set --secret apiKey …`, or apiKeys per client) because the endpoint listens on "
            f"{host}; or set vllm.allowUnauthenticated: true to serve without one",
        )
    ]


@rule("vllm.extraArgs", "vllm.maxNumSeqs")
def extra_args_as_vllm_reads_them(cfg: Any) -> list[str]:
    read = read_extra_args(cfg.vllm.extra_args)
    problems = [problem(f"vllm.extraArgs[{index}]", shown, expected) for index, shown, expected in read.problems]
    if isinstance(cfg.vllm.max_num_seqs, int) and read.has("--max-num-seqs"):
        problems.append(
            problem(
                "vllm.maxNumSeqs",
                cfg.vllm.max_num_seqs,
                "one place for it: vllm.extraArgs sets --max-num-seqs too (remove it there; the key is "
                "checked against the memory plan)",
            )
        )
    return problems


@rule(
    "vllm.speculative",
    "vllm.speculative.method",
    "vllm.speculative.promptLookupMin",
    "vllm.speculative.promptLookupMax",
    "promoteFrom",
)
def speculation_is_whole(cfg: Any) -> list[str]:
    """Speculation is part of a release (a promotion takes the release's); the prompt-lookup window is
    ngram's (vLLM ignores it for the others), and a window."""
    spec = cfg.vllm.speculative
    if spec is None:
        return []
    if cfg.promote_from is not None:
        return [
            problem(
                "vllm.speculative",
                spec.method,
                f"no value: promoteFrom {cfg.promote_from!r} decides it (its release runs with or without speculation, "
                "and was validated so)",
            )
        ]
    problems = []
    if spec.method != "ngram":
        for key, value in (("promptLookupMin", spec.prompt_lookup_min), ("promptLookupMax", spec.prompt_lookup_max)):
            if value is not None:
                problems.append(
                    problem(f"vllm.speculative.{key}", value, f"no value with method {spec.method} (ngram's only)")
                )
    elif (
        None not in (spec.prompt_lookup_min, spec.prompt_lookup_max) and spec.prompt_lookup_min > spec.prompt_lookup_max
    ):
        problems.append(
            problem(
                "vllm.speculative.promptLookupMax",
                spec.prompt_lookup_max,
                f"at least promptLookupMin ({spec.prompt_lookup_min}): vLLM refuses a window ending before it starts",
            )
        )
    return problems


# --- how it runs -------------------------------------------------------------------------------------


@rule("recovery.backoffSeconds", "recovery.maxBackoffSeconds")
def backoff_grows(cfg: Any) -> list[str]:
    recovery = cfg.recovery
    if recovery.max_backoff_seconds >= recovery.backoff_seconds:
        return []
    return [
        problem(
            "recovery.maxBackoffSeconds",
            recovery.max_backoff_seconds,
            f"at least recovery.backoffSeconds ({recovery.backoff_seconds})",
        )
    ]


@rule("edge.perSourceConnections", "edge.maxConnections")
def one_source_cannot_take_every_slot(cfg: Any) -> list[str]:
    edge = cfg.edge
    if edge.per_source_connections <= edge.max_connections:
        return []
    return [
        problem(
            "edge.perSourceConnections",
            edge.per_source_connections,
            f"at most edge.maxConnections ({edge.max_connections}): one address could hold every connection",
        )
    ]


@rule("ray.minWorkerPort", "ray.maxWorkerPort")
def worker_range_is_a_range(cfg: Any) -> list[str]:
    if cfg.ray.max_worker_port >= cfg.ray.min_worker_port:
        return []
    return [
        problem("ray.maxWorkerPort", cfg.ray.max_worker_port, f"at least ray.minWorkerPort ({cfg.ray.min_worker_port})")
    ]


PORT_KEYS = (
    "nodes[*].name", "nodes[*].sshPort", "head", "executor", "vllm.port", "vllm.masterPort", "ray.port",
    "ray.dashboard", "ray.dashboardPort", "ray.minWorkerPort", "ray.maxWorkerPort", "ray.metricsExportPort",
    "fabric.gate", "fabric.bandwidthTest", "fabric.testPort", "metrics.prometheusNode", "metrics.prometheusPort",
    "metrics.nodePort", "metrics.grafanaNode", "metrics.grafanaPort", "router.enabled", "router.node", "router.port",
    "router.metricsPort", "router.innerPort", "edge.vllmPort", "edge.metricsPort",
    "imageTransfer.method", "modelSync.enabled", "fabricCopy.source", "fabricCopy.port",
)  # fmt: skip


@rule(*PORT_KEYS)
def one_listener_a_port(cfg: Any) -> list[str]:
    """One listener a port on each node: with host networking the second dies at start."""
    problems: list[str] = []
    for node in cfg.nodes:
        listeners = node_listeners(cfg, node.index)
        for later, listener in enumerate(listeners):
            clash = next((other for other in listeners[:later] if other.overlaps(listener)), None)
            if clash is None:
                continue
            # Name the key most likely at fault: a single port before a range, a changed value before a default.
            singles = [item for item in (listener, clash) if item.first == item.last] or [listener]
            blamed = next((item for item in singles if not item.default), singles[0])
            line = problem(
                blamed.key,
                blamed.first,
                f"a port nothing else on node {node.name} listens on: {clash} and {listener} collide "
                f"(ports in use there: {'; '.join(str(item) for item in listeners)})",
            )
            if line.split(" — ")[0] not in {p.split(" — ")[0] for p in problems}:
                problems.append(line)
    return problems


@rule("network.apiSources", "network.guard")
def api_sources_need_the_guard(cfg: Any) -> list[str]:
    if not cfg.network.api_sources or cfg.network.guard:
        return []
    sources = [str(source) for source in cfg.network.api_sources]
    return [problem("network.apiSources", sources, "network.guard: true beside it (the guard enforces it)")]


@rule("fabric.bandwidthTest", "fabric.gate", "container.gpus")
def nccl_test_needs_gpus(cfg: Any) -> list[str]:
    if cfg.fabric.bandwidth_test != "nccl" or cfg.fabric.gate == "off" or cfg.container.gpus:
        return []
    return [
        problem(
            "fabric.bandwidthTest",
            "nccl",
            "tcp or off with container.gpus: false (the NCCL test runs on the nodes' GPUs)",
        )
    ]


@rule("modelSync.enabled", "model", "container.hfCacheDir")
def synced_repo_ids_need_a_directory(cfg: Any) -> list[str]:
    model = cfg.model
    if not cfg.model_sync.enabled or model is None or model.startswith("/") or cfg.container.hf_cache_dir is not None:
        return []
    return [
        problem(
            "container.hfCacheDir",
            None,
            f"a host directory, because modelSync copies model {model!r}, a Hugging Face repo id: the copy "
            "source downloads it there once and the other nodes receive it at the same path (a Docker volume "
            "cannot be copied over SSH)",
        )
    ]
