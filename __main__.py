"""spark-vllm: vLLM across several GPU machines as a Pulumi stack. Config in, one cluster, outputs out."""

import pulumi

from components.resources.cluster import VllmCluster, VllmClusterArgs, router_smoke_summary
from components.resources.ssh import ssh_access
from components.resources.stack import load_stack_config

config = load_stack_config()  # every rule is checked here, before the first resource
cluster = VllmCluster(
    "spark-vllm",
    VllmClusterArgs(
        config=config,
        ssh_access=ssh_access(config, pulumi.get_project(), pulumi.get_stack()),  # checked before any resource
    ),
)

pulumi.export("endpoint", cluster.endpoint)
if cluster.tls is not None:
    pulumi.export("tls", cluster.tls)
pulumi.export("servedModelName", cluster.served_model_name)
pulumi.export("headNode", cluster.head_node)
pulumi.export("executor", cluster.executor)
pulumi.export("rayAddress", cluster.ray_address)
pulumi.export("containers", cluster.containers)
pulumi.export("logCommands", cluster.log_commands)
pulumi.export("smoke", cluster.smoke)
pulumi.export("benchmark", cluster.benchmark)
pulumi.export("release", cluster.release)
pulumi.export("metrics", cluster.metrics)
pulumi.export("prometheusConfig", cluster.prometheus_config)
pulumi.export("memoryPlan", cluster.memory_plan)
pulumi.export("fabric", cluster.fabric)
pulumi.export("statusCommand", cluster.status_command)
pulumi.export("diagnostics", cluster.diagnostics)
pulumi.export("diagnoseCommand", cluster.diagnose_command)
pulumi.export("dashboard", cluster.dashboard)
if config.deployments:
    pulumi.export("deployments", cluster.deployments)
if cluster.router is not None:
    pulumi.export("routerSmoke", cluster.router_smoke.stdout.apply(router_smoke_summary))
