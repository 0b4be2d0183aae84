"""vLLM on the head node: wait for the Ray cluster, start `vllm serve`, wait until it serves, smoke-test it.

Each step is its own remote command so `pulumi preview` shows which one a change touches, and a
failure names the step. All of them run inside the head's Ray container through `docker exec`;
parameters (the API key among them) travel on stdin, never on a command line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig
from components.render import (
    RUN_DIR,
    VLLM_LOG,
    VLLM_PID,
    VLLM_STOP_GRACE_SECONDS,
    exec_python,
    fingerprint,
    if_container_exists,
    local_http_host,
    ray_address,
    script,
    script_program,
    serve_argv,
    shell_line,
    with_log_tail_on_failure,
    with_script,
)

POLL_SECONDS = 1  # readiness notices a ready server within this
PROGRESS_SECONDS = 30
SMOKE_PROMPT = "Reply with the single word: ready"
SMOKE_MAX_TOKENS = 16


@dataclass(frozen=True)
class VllmServerArgs:
    config: ClusterConfig
    container: str  # the head's Ray container
    container_ids: Sequence[pulumi.Input[str]]  # every Ray container: a new one re-forms the cluster
    model: pulumi.Input[str]
    engine: pulumi.Input[dict]
    connection: command.remote.ConnectionArgs
    api_key: Optional[pulumi.Input[str]]  # secret
    depends_on: Sequence[pulumi.Resource]
    node_connections: Mapping[str, command.remote.ConnectionArgs] = field(
        default_factory=dict
    )  # for memory.dropPageCache


def last_json_line(stdout: str) -> dict[str, Any]:
    for line in reversed((stdout or "").strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def smoke_summary(stdout: str) -> dict[str, Any]:
    result = last_json_line(stdout)
    return {
        "latencySeconds": result.get("latency_seconds"),
        "completionTokens": result.get("completion_tokens"),
        "promptTokens": result.get("prompt_tokens"),
    }


class VllmServer(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServerArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:VllmServer", name, None, opts)
        cfg = args.config
        self._args = args
        self.argv = pulumi.Output.all(args.model, args.engine).apply(lambda p: serve_argv(cfg, p[0], p[1]))
        self.served_model_name = pulumi.Output.from_input(args.model).apply(
            lambda model: cfg.vllm.served_model_name or model
        )
        argv_fingerprint = self.argv.apply(fingerprint)
        self.cluster_ready = self._create_cluster_wait(name)
        self.page_cache_dropped = self._create_page_cache_drops(argv_fingerprint) if cfg.memory.drop_page_cache else []
        self.serve = self._create_serve(name)
        self.ready = self._create_ready_wait(name, argv_fingerprint)
        self.smoke = self._create_smoke_test(name, argv_fingerprint) if cfg.smoke_test else None
        smoke_result = self.smoke.stdout.apply(smoke_summary) if self.smoke else pulumi.Output.from_input({})
        self.smoke_result = smoke_result
        self.register_outputs({"argv": self.argv, "smoke_result": smoke_result})

    def _head_command(self, name: str, timeout: int, stdin: pulumi.Input[str], **kwargs) -> command.remote.Command:
        args = self._args
        node = args.config.head_node
        opts = kwargs.pop("opts", pulumi.ResourceOptions())
        return command.remote.Command(
            name,
            connection=args.connection,
            create=with_log_tail_on_failure(exec_python(args.container, timeout), node, args.container),
            stdin=stdin,
            add_previous_output_in_env=False,
            opts=pulumi.ResourceOptions.merge(pulumi.ResourceOptions(parent=self), opts),
            **kwargs,
        )

    def _create_cluster_wait(self, name: str) -> command.remote.Command:
        cfg = self._args.config
        params = {
            "node": cfg.head_node.name,
            "ray_address": ray_address(cfg),
            "expected": [{"name": n.name, "fabric_address": str(n.fabric_address)} for n in cfg.nodes],
            "gpus_needed": cfg.world_size,
            "timeout_seconds": cfg.ray.join_timeout_seconds,
            "poll_seconds": POLL_SECONDS,
            "progress_seconds": PROGRESS_SECONDS,
        }
        # A read-only wait has nothing to undo, hence no delete.
        return self._head_command(
            f"{name}-cluster-ready",
            cfg.ray.join_timeout_seconds + 60,
            script_program("ray_join.py", params),
            triggers=list(self._args.container_ids),
            opts=pulumi.ResourceOptions(depends_on=list(self._args.depends_on)),
        )

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
                command.remote.Command(
                    f"{node.name}-drop-page-cache",
                    connection=self._args.node_connections[node.name],
                    create=drop,
                    # Again whenever vLLM starts afresh: new arguments, a re-formed cluster, a restart.
                    triggers=[argv_fingerprint, self.cluster_ready.id, cfg.vllm.restart_generation],
                    add_previous_output_in_env=False,
                    opts=pulumi.ResourceOptions(parent=self, depends_on=[self.cluster_ready]),
                )
            )
        return drops

    def _create_serve(self, name: str) -> command.remote.Command:
        args = self._args
        cfg = args.config

        def program(parts: list) -> str:
            argv, api_key = parts
            env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(cfg.vllm.ready_timeout_seconds)}
            if api_key:
                env["VLLM_API_KEY"] = api_key  # vLLM reads it when --api-key is absent
            return script_program(
                "serve_start.py",
                {
                    "argv": argv,
                    "env": env,
                    "fingerprint": fingerprint([argv, env]),
                    "log_file": VLLM_LOG,
                    "pid_file": VLLM_PID,
                    "fingerprint_file": f"{RUN_DIR}/vllm.fingerprint",
                    "stop_grace_seconds": VLLM_STOP_GRACE_SECONDS,
                    "settle_seconds": 3,
                },
            )

        stop = ["docker", "exec", "-i", args.container, "python3", "-", VLLM_PID, str(VLLM_STOP_GRACE_SECONDS)]
        delete = with_script(if_container_exists(args.container, stop), script("serve_stop.py"))
        return self._head_command(
            f"{name}-serve",
            VLLM_STOP_GRACE_SECONDS + 120,
            pulumi.Output.all(self.argv, args.api_key).apply(program),
            delete=delete,
            # A re-formed Ray cluster (any new container: vLLM's workers died with the old one) or a
            # bumped restartGeneration starts vLLM afresh.
            triggers=[self.cluster_ready.id, cfg.vllm.restart_generation],
            opts=pulumi.ResourceOptions(
                depends_on=[self.cluster_ready, *self.page_cache_dropped],
                # Stop the old server before starting the new one: they would share GPUs and the port.
                delete_before_replace=True,
                # A failed start prints the vLLM log tail; keep what a log could echo out of plain state.
                additional_secret_outputs=["stdin", "stdout", "stderr"],
            ),
        )

    def _http_params(self) -> dict[str, Any]:
        cfg = self._args.config
        return {"base_url": f"http://{local_http_host(cfg)}:{cfg.vllm.port}"}

    def _create_ready_wait(self, name: str, argv_fingerprint: pulumi.Output[str]) -> command.remote.Command:
        cfg = self._args.config
        timeout = cfg.vllm.ready_timeout_seconds

        def program(parts: list) -> str:
            served, api_key = parts
            params = {
                **self._http_params(),
                "model": served,
                "api_key": api_key,
                "timeout_seconds": timeout,
                "poll_seconds": POLL_SECONDS,
                "progress_seconds": PROGRESS_SECONDS,
                "log_file": VLLM_LOG,
                "pid_file": VLLM_PID,
            }
            return script_program("wait_ready.py", params)

        return self._head_command(
            f"{name}-ready",
            timeout + 60,
            pulumi.Output.all(self.served_model_name, self._args.api_key).apply(program),
            # Runs again whenever vLLM was (re)started with other arguments; read-only, no delete.
            triggers=[self.serve.id, argv_fingerprint],
            opts=pulumi.ResourceOptions(
                depends_on=[self.serve], additional_secret_outputs=["stdin", "stdout", "stderr"]
            ),
        )

    def _create_smoke_test(self, name: str, argv_fingerprint: pulumi.Output[str]) -> command.remote.Command:
        def program(parts: list) -> str:
            served, api_key = parts
            params = {
                **self._http_params(),
                "model": served,
                "api_key": api_key,
                "prompt": SMOKE_PROMPT,
                "max_tokens": SMOKE_MAX_TOKENS,
                "timeout_seconds": 120,
            }
            return script_program("smoke.py", params)

        return self._head_command(
            f"{name}-smoke",
            180,
            pulumi.Output.all(self.served_model_name, self._args.api_key).apply(program),
            triggers=[self.ready.id, argv_fingerprint],
            opts=pulumi.ResourceOptions(depends_on=[self.ready]),
        )


def log_follow_command(cfg: ClusterConfig, node_name: str, container: str, vllm: bool) -> str:
    node = next(n for n in cfg.nodes if n.name == node_name)
    remote = (
        ["docker", "exec", container, "tail", "-n", "200", "-f", VLLM_LOG]
        if vllm
        else ["docker", "logs", "--tail", "200", "-f", container]
    )
    return shell_line(["ssh", "-t", "-p", str(node.ssh_port), f"{node.user}@{node.host}", shell_line(remote)])
