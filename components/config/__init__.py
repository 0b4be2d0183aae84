"""The stack config of spark-vllm: pydantic models of the whole `spark-vllm:` namespace and every rule it
must satisfy, checked before the first resource exists.

No I/O happens here: the models are filled from a plain dict (``load_cluster_config``), so the same
rules run under `pulumi up`, under Pulumi's mocks and in pure unit tests.

  types.py      value types, each with its own rule (names, addresses, paths, keys, secrets)
  sections.py   a node, and each object key (vllm, ray, fabric, container, …)
  ssh_keys.py, vllm_args.py  what an SSH key and extraArgs really are
  deployments.py  ModelSettings (one model's keys), DeploymentConfig, the router, replica names
  models.py     ClusterConfig, the whole namespace, and what follows from it (head, workers, …)
  replicas.py   each deployment's replicas as single-model views, and the rules that hold across them
  node_rules.py, deployment_rules.py  the cross-field rules of the nodes and of the deployments
  listeners.py  the ports each node's listeners take
  runner.py     how the cross-field rules run: each on the keys it declares, where they are valid
  rules.py      the cross-field rules
  errors.py     problems told as one line each; ConfigError
  key_paths.py  every key's path; pydantic's errors told at their key paths (unknown keys, secrets hidden)
  loading.py    load_cluster_config, and what the stack around the config can say
"""

from components.config.errors import ConfigError
from components.config.key_paths import config_keys
from components.config.listeners import node_listeners
from components.config.loading import load_cluster_config, near_namespace
from components.config.models import ClusterConfig, auto_executor
from components.config.sections import ImageTransferConfig, NetworkConfig, NodeConfig, ReleaseConfig
from components.config.types import NAMESPACE

# What the rest of the program takes from the config; the other names are read from their own modules.
__all__ = [
    "NAMESPACE", "ClusterConfig", "ConfigError", "ImageTransferConfig", "NetworkConfig", "NodeConfig",
    "ReleaseConfig", "auto_executor", "config_keys", "load_cluster_config", "near_namespace", "node_listeners",
]  # fmt: skip
