"""One endpoint for every deployment: vllm-router (PyPI, vllm-project/router) as the container
spark-vllm.router on router.node, kept by components/scripts/router_keeper.py, and the steps around each
replica that let a change reach the replicas one at a time with no request lost:

  `<replica>-router-drain`   out of the router, and idle (its running requests finished), before anything
                             of the replica changes (its containers, vLLM's settings);
  `<replica>-router-undrain` back in, once it serves again (ready, smoke-tested);

and the next replica of the deployment drains only after the last one is back. `spark-vllm-router-workers`
declares every replica (a removed one leaves the router before its vLLM stops) and `spark-vllm-router-smoke`
asks each model once through the router."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import ClusterConfig
from components.plan.container import log_options
from components.plan.edge import SEES_UPSTREAM_SECONDS
from components.plan.endpoint import edge_node, vllm_url
from components.plan.engine import EngineSettings
from components.plan.names import (
    ROUTER_INSTALL_DIR,
    ROUTER_USER_ID,
    SMOKE_MAX_TOKENS,
    SMOKE_PROMPT,
    SMOKE_TIMEOUT_SECONDS,
)
from components.plan.programs import script_program
from components.plan.router_params import keeper_params, router_node
from components.plan.shell import exec_python, fingerprint, with_log_tail_on_failure
from components.resources.steps import SECRET_IO, remote_step, service_container

ROUTER_CONTAINER = "spark-vllm.router"  # a dot: no node's container (spark-vllm-<DNS label>) has it
ROUTER_VOLUME = "spark-vllm-router"  # vllm-router installed once per version, when the image lacks it
INSTALL_DIR = ROUTER_INSTALL_DIR
READY_TIMEOUT_SECONDS = 600  # a first start may install vllm-router from PyPI
STEP_TIMEOUT_SECONDS = 120
DRAIN_TIMEOUT_SECONDS = 900  # a replica's longest request finishing (benchmark-sized requests take minutes)


def worker(replica: Any, served: str, max_model_len: Optional[int], root: Optional[str] = None) -> dict[str, Any]:
    """A replica as the router's keeper declares it; `root` (the model it loaded) and `max_model_len` are what the
    endpoint's /v1/models says of its model, as vLLM would: both from what the replica deploys (the release's, with
    promoteFrom), the values its vLLM is started with, not the stack's config."""
    return {"url": vllm_url(replica.config), "model": served, "replica": replica.config.called("spark-vllm"),
            "root": root, "max_model_len": max_model_len}  # fmt: skip


@dataclass(frozen=True)
class ReplicaSteps:
    drain: command.remote.Command
    undrain: Optional[command.remote.Command]
    params: pulumi.Output  # {"worker": …}
    triggers: list


class Router(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        cfg: ClusterConfig,
        provider: docker.Provider,
        connection: command.remote.ConnectionArgs,
        image_id: pulumi.Input[str],
        depends_on: Sequence[pulumi.Resource],
        opts: Optional[pulumi.ResourceOptions] = None,
    ):
        super().__init__("spark-vllm:index:Router", name, None, opts)
        self._cfg, self._connection = cfg, connection
        self._node = router_node(cfg)
        self.container = service_container(
            f"{name}-router",
            name=ROUTER_CONTAINER,
            image=image_id,
            entrypoints=["python3", "-u", "-c", script_program("router_keeper.py", keeper_params(cfg, "serve"))],
            mounts=[docker.ContainerMountArgs(type="volume", source=ROUTER_VOLUME, target=INSTALL_DIR)],
            restart=cfg.container.restart,
            logs=log_options(cfg),
            user=ROUTER_USER_ID,  # the keeper: one of the two network.guard lets reach vllm-router's port
            init=True,
            node=self._node.name,
            role="router",
            guarded=cfg.network.guard,  # router.metricsPort is fenced
            provider=provider,
            parent=self,
            depends_on=depends_on,
        )
        self.ready = self._step(
            f"{name}-router-ready",
            keeper_params(cfg, "ready", timeout=READY_TIMEOUT_SECONDS),
            READY_TIMEOUT_SECONDS,
            triggers=[self.container.id],
        )
        self.register_outputs({"container_id": self.container.id})

    def _step(self, name: str, params: pulumi.Input[dict], timeout: int, **kwargs: Any) -> command.remote.Command:
        """The keeper in one of its modes, in the router's container (`docker exec -i … python3 -`)."""
        create = with_log_tail_on_failure(exec_python(ROUTER_CONTAINER, timeout + 30), self._node, ROUTER_CONTAINER)
        program = pulumi.Output.from_input(params).apply(lambda p: script_program("router_keeper.py", p))
        return remote_step(name, self._connection, create, stdin=program, parent=self, **kwargs)

    def drain(
        self,
        replica: Any,
        served: pulumi.Input[str],
        engine: pulumi.Input[EngineSettings],
        triggers: Sequence[pulumi.Input],
        after: Sequence[pulumi.Resource],
    ) -> ReplicaSteps:
        """A replica out of the router and idle before `triggers` change anything of it, after `after` (the
        previous replica of its deployment back in); `engine`: the settings it deploys."""
        params = pulumi.Output.all(served=served, engine=engine).apply(
            lambda found: {"worker": worker(replica, found["served"], found["engine"].max_model_len)}
        )
        drain = self._step(
            replica.config.named("router-drain", alone="spark-vllm"),
            params.apply(lambda p: keeper_params(self._cfg, "drain", timeout=DRAIN_TIMEOUT_SECONDS, **p)),
            2 * DRAIN_TIMEOUT_SECONDS,
            triggers=[*triggers, self.container.id],
            depends_on=[self.ready, *after],
        )
        return ReplicaSteps(drain, None, params, list(triggers))

    def undrain(self, replica: Any, steps: ReplicaSteps, serving: pulumi.Resource) -> ReplicaSteps:
        """The replica back in the router once `serving` (its smoke test, or its readiness) passed."""
        undrain = self._step(
            replica.config.named("router-undrain", alone="spark-vllm"),
            steps.params.apply(lambda p: keeper_params(self._cfg, "undrain", timeout=STEP_TIMEOUT_SECONDS, **p)),
            STEP_TIMEOUT_SECONDS,
            triggers=[*steps.triggers, self.container.id, serving.id],
            depends_on=[serving, steps.drain],
        )
        return ReplicaSteps(steps.drain, undrain, steps.params, steps.triggers)

    def declare(
        self,
        workers: pulumi.Input[list],
        undrains: Sequence[pulumi.Resource],
        api_key: Optional[pulumi.Input[str]],
        edge: pulumi.Resource,
    ) -> tuple[command.remote.Command, command.remote.Command]:
        """Every replica declared (what is not, leaves the router), then each model asked once through it, from
        the network's side of the edge (`edge`: its configuration applied)."""
        declared = self._step(
            "spark-vllm-router-workers",
            pulumi.Output.from_input(workers).apply(
                lambda found: keeper_params(self._cfg, "workers", timeout=STEP_TIMEOUT_SECONDS, workers=found)
            ),
            STEP_TIMEOUT_SECONDS,
            triggers=[self.container.id, pulumi.Output.from_input(workers).apply(fingerprint)],
            depends_on=list(undrains),
        )
        models = pulumi.Output.from_input(workers).apply(lambda w: sorted({each["model"] for each in w}))
        smoke = self._step(
            "spark-vllm-router-smoke",
            pulumi.Output.all(models=models, api_key=api_key).apply(lambda found: self._smoke_params(**found)),
            SMOKE_TIMEOUT_SECONDS * 2,
            triggers=[declared.id, models],
            depends_on=[declared, edge],
            secret_outputs=SECRET_IO,
        )
        return declared, smoke

    def _smoke_params(self, models: list[str], api_key: Optional[str]) -> dict[str, Any]:
        tls = self._cfg.tls
        return keeper_params(
            self._cfg,
            "smoke",
            models=models,
            api_key=api_key,
            # over TLS: verified with tls.ca, for the name clients reach the endpoint at
            tls_ca=tls.ca if tls is not None else None,
            server_name=edge_node(self._cfg).host if tls is not None else None,
            prompt=SMOKE_PROMPT,
            max_tokens=SMOKE_MAX_TOKENS,
            timeout=SMOKE_TIMEOUT_SECONDS,
            wait_served_seconds=SEES_UPSTREAM_SECONDS,
        )
