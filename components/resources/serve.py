"""vLLM: wait for the Ray cluster, hand vLLM's settings to the supervisors, wait until it serves,
smoke-test it.

Each step is its own remote command so `pulumi preview` shows which one a change touches, and a
failure names the step. They run inside the nodes' containers through `docker exec`; parameters
(the API key among them) travel on stdin, never on a command line. With Ray the head runs vLLM;
with executor mp every node runs its rank, so every node gets its settings (`<node>-serve`; the
head's step is `spark-vllm-serve` in both executors). The supervisor in each container starts and
restarts vLLM (components/scripts/supervisor.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig, NodeConfig
from components.plan.container import cluster_wait_params, node_resource
from components.plan.engine import EngineSettings
from components.plan.names import (
    RUN_DIR,
    SERVE_HANDOVER_SECONDS,
    SMOKE_TIMEOUT_SECONDS,
    STATUS_FILE,
    VLLM_LOG,
    VLLM_STOP_GRACE_SECONDS,
)
from components.plan.programs import printed, script, script_chain, script_program
from components.plan.serving import (
    answers_params,
    benchmark_params,
    endpoint_smoke_params,
    handover_params,
    ready_params,
    serve_argv,
    smoke_params,
)
from components.plan.shell import (
    exec_python,
    fingerprint,
    if_container_running,
    shell_line,
    with_log_tail_on_failure,
    with_script,
)
from components.resources.steps import SECRET_IO, remote_step
from components.scripts.node_contract import AnswersResult, BenchmarkFigures, HandoverResult, SmokeResult, Tenancy


@dataclass(frozen=True)
class VllmServerArgs:
    config: ClusterConfig
    containers: Mapping[str, str]  # node name -> its container's name
    container_ids: Mapping[str, pulumi.Input[str]]  # node name -> container id: a new one re-forms the group
    model: pulumi.Input[str]
    engine: pulumi.Input[dict]
    connections: Mapping[str, command.remote.ConnectionArgs]
    api_key: Optional[pulumi.Input[str]]  # secret
    depends_on: Sequence[pulumi.Resource]
    # vllm.maxNumSeqs auto: the --max-num-seqs the memory plan set (a hybrid model's cache), or None
    max_num_seqs: pulumi.Input[Optional[int]] = None
    # a replica that shares a GPU: the KV cache its memory plan pinned (bytes), or None
    kv_cache_bytes: pulumi.Input[Optional[int]] = None
    # whether the image's vLLM has --enable-scale-out (the gate's vllm record): cache_aware routing needs it
    scale_out: pulumi.Input[bool] = False
    # node -> the replica's place there when it shares the node with others (the GPU turn, the neighbours)
    tenancy: Mapping[str, Tenancy] = dataclasses.field(default_factory=dict)
    # a promoted release with speculation: the answers (and benchmark) its validation held it against
    kept_baseline: pulumi.Input[Optional[dict]] = None


def started(serve: command.remote.Command) -> pulumi.Output:
    """What a serve step left running: vLLM's pid and settings (its HandoverResult)."""
    return serve.stdout.apply(lambda out: _through(HandoverResult, printed(out)))


def _through(contract: type, found: dict[str, Any]) -> dict[str, Any]:
    """`found` read through its contract and back ({} stays {}): a key the script and the program do not share
    fails here, with the step's own output in the message."""
    return contract.from_json(found).to_json() if found else {}


def smoke_summary(stdout: str) -> dict[str, Any]:
    found = printed(stdout)
    if "chain" in found:  # with speculation: smoke.py first in the validation's chain
        found = found["chain"].get("smoke.py") or {}
    result = SmokeResult.from_json(found) if found else None
    return {
        "latencySeconds": result.latency_seconds if result else None,
        "completionTokens": result.completion_tokens if result else None,
        "promptTokens": result.prompt_tokens if result else None,
    }


class VllmServer(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServerArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:VllmServer", name, None, opts)
        cfg = args.config
        self._args, self._name = args, name
        self.argv = self._argv(None)
        self.served_model_name = pulumi.Output.from_input(args.model).apply(
            lambda model: cfg.vllm.served_model_name or model
        )
        argv_fingerprint = self.argv.apply(fingerprint)
        self.cluster_ready = self._create_cluster_wait(name) if cfg.executor == "ray" else None
        self.page_cache_dropped = self._create_page_cache_drops(argv_fingerprint) if cfg.memory.drop_page_cache else []
        # vllm.speculative from this stack's config: first a start without it, whose answers (and benchmark)
        # the validation holds the speculative start against; kept in state until the rest changes
        speculative = cfg.vllm.speculative is not None and cfg.promote_from is None and cfg.smoke_test
        self.baseline = self._create_baseline(name) if speculative else None
        if cfg.vllm.speculative is not None:
            spec = cfg.vllm.speculative
            pulumi.log.info(
                cfg.said(f"vllm.speculative: {spec.method}, {spec.tokens} tokens")
                + ": a vLLM-only change (vLLM restarts with --speculative-config, no container is replaced); "
                "its validation holds the greedy answers to those of a start without it "
                + ("(spark-vllm-baseline, kept until the model, image or other settings change)" if speculative
                   else "(smokeTest is off: no validation)")
            )  # fmt: skip
        self.worker_serves = self._create_worker_serves() if cfg.executor == "mp" else []
        self.serve = self._create_serve(name, cfg.head_node, f"{name}-serve")
        self.ready = self._create_ready_wait(name, argv_fingerprint)
        self.smoke = self._create_smoke_test(name, argv_fingerprint) if cfg.smoke_test else None
        smoke_result = self.smoke.stdout.apply(smoke_summary) if self.smoke else pulumi.Output.from_input({})
        self.smoke_result = smoke_result
        self.benchmark = self._create_benchmark(name, argv_fingerprint) if cfg.benchmark.enabled else None
        self.benchmark_result = (
            self.benchmark.stdout.apply(lambda out: _through(BenchmarkFigures, printed(out)))
            if self.benchmark
            else pulumi.Output.from_input(None)
        )
        self.validation = self.smoke.stdout.apply(validation_summary) if self.smoke else pulumi.Output.from_input(None)
        self.register_outputs({"argv": self.argv, "smoke_result": smoke_result, "benchmark": self.benchmark_result})

    def through_endpoint(
        self, triggers: Sequence[pulumi.Input], after: Sequence[pulumi.Resource]
    ) -> Optional[command.remote.Command]:
        """Without the router: one short chat completion through the endpoint (the edge on the head), as a client
        sends it, after `after` (the edge's configuration): over TLS with `tls`, the certificate verified with
        tls.ca for the endpoint's host, never unverified; once the edge's /health says its checks see vLLM serve.
        Runs again on `triggers` and whenever the head's own smoke test (or benchmark) did, after every start of
        vLLM: the edge's checks saw that vLLM go, and a request sent the moment `up` ends would meet the edge's 503
        until they see it back. What the router's smoke is to several models. None with smokeTest off."""
        if self.smoke is None:
            return None
        last = self.benchmark or self.smoke
        return self._head_command(
            f"{self._name}-endpoint-smoke",
            SMOKE_TIMEOUT_SECONDS + 60,
            self._served_program("smoke.py", endpoint_smoke_params),
            triggers=[*triggers, last.id],
            # after the benchmark too: a request of its own inside the benchmark's window would count in its figures
            depends_on=[*after, last],
            secret_outputs=SECRET_IO,
        )

    def _argv(self, node: Optional[NodeConfig], baseline: bool = False) -> pulumi.Output[list[str]]:
        """`vllm serve …` for `node`; `baseline`: without speculation."""
        args = self._args
        found = pulumi.Output.all(model=args.model, engine=args.engine, max_num_seqs=args.max_num_seqs,
                                  kv_cache_bytes=args.kv_cache_bytes, scale_out=args.scale_out)  # fmt: skip
        return found.apply(
            lambda p: serve_argv(
                args.config,
                p["model"],
                p["engine"].without_speculation() if baseline else p["engine"],
                node,
                max_num_seqs=p["max_num_seqs"],
                kv_cache_bytes=p["kv_cache_bytes"],
                scale_out=p["scale_out"],
            )
        )

    @property
    def baseline_result(self) -> pulumi.Output:
        """What the release's answers are held against: this stack's start without speculation ({"answers",
        "benchmark", "source"}), the promoted release's kept one, or None."""
        if self.baseline is not None:
            return self.baseline.stdout.apply(baseline_summary)
        return pulumi.Output.from_input(self._args.kept_baseline)

    def _create_baseline(self, name: str) -> command.remote.Command:
        """The start without speculation: every rank handed the settings without it, then on the head the
        readiness wait, the validation's answers and (benchmark.enabled) the benchmark, in one step. Runs
        again only when what else the answers depend on changes (the containers, the model, the other engine
        settings): turning speculation on, off, or changing its tokens leaves it as it is."""
        cfg = self._args.config
        key = [*self._args.container_ids.values(), self._argv(None, baseline=True).apply(fingerprint)]
        nodes = [cfg.head_node, *(cfg.workers if cfg.executor == "mp" else [])]
        serves = [
            self._create_serve(name, node, node_resource(cfg, node, "baseline-serve"), baseline=key)
            if node is not cfg.head_node
            else self._create_serve(name, node, f"{name}-baseline-serve", baseline=key)
            for node in nodes
        ]

        def program(served: str, model: str, api_key: str) -> str:
            steps = [
                ("wait_ready.py", ready_params(cfg, served, api_key)),
                ("node_answers.py", answers_params(cfg, served, api_key)),
            ]
            if cfg.benchmark.enabled:
                steps.append(("node_benchmark.py", benchmark_params(cfg, served, model, api_key)))
            return script_chain(steps)

        timeout = cfg.vllm.ready_timeout_seconds + 5 * SMOKE_TIMEOUT_SECONDS + 60
        timeout += cfg.benchmark.timeout_seconds + 360 if cfg.benchmark.enabled else 0
        return self._head_command(
            f"{name}-baseline",
            timeout,
            pulumi.Output.all(served=self.served_model_name, model=self._args.model, api_key=self._args.api_key).apply(
                lambda found: program(**found)
            ),
            triggers=key,
            depends_on=serves,
            secret_outputs=["stdin"],
        )

    def _head_command(self, name: str, timeout: int, stdin: pulumi.Input[str], **kwargs) -> command.remote.Command:
        return self._node_command(self._args.config.head_node, name, timeout, stdin, **kwargs)

    def _node_command(
        self, node: NodeConfig, name: str, timeout: int, stdin: pulumi.Input[str], **kwargs
    ) -> command.remote.Command:
        """A script run in `node`'s container (`docker exec -i … python3 -`, the program on stdin), bounded by
        `timeout`; on failure the node's name and its container's log tail."""
        container = self._args.containers[node.name]
        create = with_log_tail_on_failure(exec_python(container, timeout), node, container)
        return remote_step(name, self._args.connections[node.name], create, parent=self, stdin=stdin, **kwargs)

    def _create_cluster_wait(self, name: str) -> command.remote.Command:
        cfg = self._args.config
        params = cluster_wait_params(cfg)
        # A read-only wait has nothing to undo, hence no delete.
        return self._head_command(
            f"{name}-cluster-ready",
            cfg.ray.join_timeout_seconds + 60,
            script_program("ray_join.py", params),
            triggers=list(self._args.container_ids.values()),
            depends_on=self._args.depends_on,
        )

    def _before_serve(self) -> list[pulumi.Resource]:
        waits = [self.cluster_ready] if self.cluster_ready is not None else list(self._args.depends_on)
        baseline = getattr(self, "baseline", None)  # the start without speculation goes first
        return [*waits, *self.page_cache_dropped, *([baseline] if baseline is not None else [])]

    def _create_page_cache_drops(self, argv_fingerprint: pulumi.Output[str]) -> list[command.remote.Command]:
        """memory.dropPageCache: on every node, just before vLLM (re)starts, the kernel drops clean
        cached file pages. They would be given back on demand anyway, but vLLM sizes its KV cache from
        the memory it sees free when it starts (vLLM #35313), and on unified memory a full page cache
        makes that too little. Nothing is lost: dropped pages are read from disk again when needed."""
        cfg = self._args.config
        drops = []
        for node in cfg.nodes:
            sudo = [] if node.user == "root" else ["sudo", "-n"]
            drop = shell_line([*sudo, "sh", "-c", "sync && echo 1 > /proc/sys/vm/drop_caches"])
            drops.append(
                remote_step(
                    node_resource(cfg, node, "drop-page-cache"),
                    self._args.connections[node.name],
                    drop,
                    # Again whenever vLLM starts afresh: new arguments, a re-formed group, a restart.
                    triggers=[argv_fingerprint, *self._group_triggers()],
                    parent=self,
                    depends_on=[self.cluster_ready] if self.cluster_ready else self._args.depends_on,
                )
            )
        return drops

    def _group_triggers(self) -> list:
        """What starts vLLM afresh: a re-formed Ray cluster (any new container: vLLM's workers died with
        the old one) or, with mp, a new container of any rank; and a bumped restartGeneration."""
        cfg = self._args.config
        if self.cluster_ready is not None:
            return [self.cluster_ready.id, cfg.vllm.restart_generation]
        return [*self._args.container_ids.values(), cfg.vllm.restart_generation]

    def _create_worker_serves(self) -> list[command.remote.Command]:
        """executor mp: every worker's rank gets its settings too (`--headless`, its --node-rank)."""
        cfg = self._args.config
        return [self._create_serve("", node, node_resource(cfg, node, "serve")) for node in cfg.workers]

    def _create_serve(
        self, name: str, node: NodeConfig, resource_name: str, baseline: Optional[list] = None
    ) -> command.remote.Command:
        """The handover of `vllm serve`'s settings to `node`'s supervisor; `baseline` (its triggers): the
        settings without speculation, with no delete (what stops vLLM is the real serve step's)."""
        args = self._args
        cfg = args.config
        container = args.containers[node.name]
        head = node.name == cfg.head_node.name
        if baseline is not None:
            argv = self._argv(None if head else node, baseline=True)
        else:
            argv = self.argv if head else self._argv(node)

        def program(node_argv: list[str], api_key: Optional[str]) -> str:
            shared = args.tenancy.get(node.name)
            return script_program("serve_spec.py", handover_params(cfg, node, node_argv, api_key, shared))

        if baseline is not None:  # the start without speculation: no delete (the serve step's stops vLLM)
            step = {"triggers": baseline}
        else:
            stop = ["docker", "exec", "-i", container, "python3", "-", RUN_DIR, str(VLLM_STOP_GRACE_SECONDS)]
            step = {
                # a stopped head (crashed, stopped by hand) has no vLLM to stop: destroy goes on
                "delete": with_script(if_container_running(container, stop), script("serve_stop.py")),
                "triggers": self._group_triggers() if head else [args.container_ids[node.name]],
                # Stop the old server before starting the new one: they would share GPUs and the port.
                "delete_before_replace": True,
            }
        return self._node_command(
            node,
            resource_name,
            SERVE_HANDOVER_SECONDS + 60,
            # the API key only where vLLM's API server runs: a headless rank (mp) never reads it, and a
            # worker that has it leaves it in its compile cache's metadata (see the supervisor's redaction)
            pulumi.Output.all(node_argv=argv, api_key=args.api_key if head else None).apply(lambda p: program(**p)),
            depends_on=self._before_serve(),
            # A failed start prints the vLLM log tail; keep what a log could echo out of plain state.
            secret_outputs=SECRET_IO,
            **step,
        )

    def _served_program(self, name: str, params: Callable[..., dict[str, Any]]) -> pulumi.Output[str]:
        """The script `name` with `params(cfg, served name, vLLM's key)`: what a head step reads on stdin."""
        cfg = self._args.config
        return pulumi.Output.all(served=self.served_model_name, api_key=self._args.api_key).apply(
            lambda found: script_program(name, params(cfg, found["served"], found["api_key"]))
        )

    def _create_ready_wait(self, name: str, argv_fingerprint: pulumi.Output[str]) -> command.remote.Command:
        timeout = self._args.config.vllm.ready_timeout_seconds
        return self._head_command(
            f"{name}-ready",
            timeout + 60,
            self._served_program("wait_ready.py", ready_params),
            # Runs again whenever a serve step started vLLM anew (another pid or other settings), also
            # after an `up` that failed while waiting; read-only, no delete.
            triggers=[self.serve.id, argv_fingerprint, *[started(step) for step in [self.serve, *self.worker_serves]]],
            depends_on=[self.serve, *self.worker_serves],
            secret_outputs=SECRET_IO,
        )

    def _create_smoke_test(self, name: str, argv_fingerprint: pulumi.Output[str]) -> command.remote.Command:
        cfg = self._args.config

        def program(served: str, api_key: str, engine: EngineSettings, baseline: Optional[dict]) -> str:
            smoke = smoke_params(cfg, served, api_key)
            if engine.speculative is None:
                return script_program("smoke.py", smoke)  # as it always was: no release without it changes
            # with speculation: the validation's answers, held against those without it (none kept: all differ)
            answers = answers_params(cfg, served, api_key, list((baseline or {}).get("answers") or []))
            return script_chain([("smoke.py", smoke), ("node_answers.py", answers)])

        return self._head_command(
            f"{name}-smoke",
            SMOKE_TIMEOUT_SECONDS + 60,
            pulumi.Output.all(
                served=self.served_model_name,
                api_key=self._args.api_key,
                engine=self._args.engine,
                baseline=self.baseline_result,
            ).apply(lambda found: program(**found)),
            triggers=[self.ready.id, argv_fingerprint],
            depends_on=[self.ready],
        )

    def _create_benchmark(self, name: str, argv_fingerprint: pulumi.Output[str]) -> command.remote.Command:
        """benchmark.enabled: the configured load after the smoke test (components/scripts/node_benchmark.py).
        Runs again when vLLM started anew or the benchmark's settings changed; read-only, no delete."""
        cfg = self._args.config

        def program(served: str, model: str, api_key: str) -> str:
            return script_program("node_benchmark.py", benchmark_params(cfg, served, model, api_key))

        settings = fingerprint(cfg.benchmark.model_dump(mode="json"))
        after = self.smoke or self.ready
        return self._head_command(
            f"{name}-benchmark",
            cfg.benchmark.timeout_seconds + 360,  # a `vllm bench serve --help` probe, then the load
            pulumi.Output.all(served=self.served_model_name, model=self._args.model, api_key=self._args.api_key).apply(
                lambda found: program(**found)
            ),
            triggers=[after.id, argv_fingerprint, settings],
            depends_on=[after],
            secret_outputs=["stdin"],
        )


def baseline_summary(stdout: str) -> dict[str, Any]:
    """The start without speculation, as the release keeps it: its answers and benchmark figures."""
    chain = printed(stdout).get("chain") or {}
    found = chain.get("node_answers.py")
    answers = [each.to_json() for each in AnswersResult.from_json(found).answers] if found else []
    benchmark = _through(BenchmarkFigures, chain.get("node_benchmark.py") or {}) or None
    return {"answers": answers, "benchmark": benchmark, "source": "a start without speculation"}


def validation_summary(stdout: str) -> Optional[dict[str, Any]]:
    """With speculation, how the validation's answers compared ({"compared", "agreed"}); else None."""
    chain = printed(stdout).get("chain")
    if not chain:
        return None
    found = chain.get("node_answers.py")
    agreement = AnswersResult.from_json(found).agreement if found else None
    return {"compared": agreement.compared if agreement else None, "agreed": agreement.agreed if agreement else None}


def log_follow_command(cfg: ClusterConfig, node_name: str, container: str, vllm: bool) -> str:
    node = next(n for n in cfg.nodes if n.name == node_name)
    remote = (
        ["docker", "exec", container, "tail", "-n", "200", "-f", VLLM_LOG]
        if vllm
        else ["docker", "logs", "--tail", "200", "-f", container]
    )
    return shell_line(["ssh", "-t", "-p", str(node.ssh_port), f"{node.user}@{node.host}", shell_line(remote)])


# What a node's supervisor says of vLLM: the summary line it writes into status.json (SupervisorStatus.summarize,
# computed on the node from the contract); a supervisor started before it wrote one has its keys read here instead.
STATUS_SUMMARY = (
    "import json; s = json.load(open({path!r})); e = s.get('last_exit') or {{}}; f = s.get('last_fault'); "
    "print(s.get('summary') or 'vLLM: %s, serving: %s, restarts: %s (%s in the window), last exit: %s %s%s' % ("
    "s['state'], 'yes' if s.get('serving') else 'no', s.get('restarts_total'), s.get('restarts_in_window'), "
    "e.get('code', '-'), e.get('error', ''), ('; GAVE UP: ' + s['failed']) if s.get('failed') else "
    "('; waiting: ' + s['gpu_busy']) if s.get('gpu_busy') else ('; GPU turn: ' + s['turn']) if s.get('turn') "
    "else '') + ('\\nlast ended while /health answered: %s at %s: %s' % (f['kind'], f['at'], f['detail']) if f "
    "else ''))"
)


def status_command(cfg: ClusterConfig, containers: Mapping[str, Any]) -> str:
    """One command printing, per node: its container's state and Docker restart count, and what its
    supervisor says of vLLM (state, serving, restarts, last error); with deployments, per container of a
    replica there (`containers`: node -> its containers)."""
    lines = []
    for node in cfg.nodes:
        found = containers.get(node.name) or []
        for container in [found] if isinstance(found, str) else found:
            title = f"== {node.name}" if isinstance(found, str) else f"== {node.name} {container}"
            lines.append(_status_of(node, container, title))
    return "; ".join(lines)


def _status_of(node: NodeConfig, container: str, title: str) -> str:
    remote = "; ".join(
        [
            shell_line(
                [
                    "docker",
                    "inspect",
                    "-f",
                    "container {{.State.Status}}, restarted by Docker {{.RestartCount}} time(s)",
                    container,
                ]
            ),  # fmt: skip
            shell_line(["docker", "exec", container, "python3", "-c", STATUS_SUMMARY.format(path=STATUS_FILE)]),
        ]
    )
    ssh = shell_line(["ssh", "-p", str(node.ssh_port), f"{node.user}@{node.host}", remote])
    return f"echo {shell_line([title])}; {ssh}"
