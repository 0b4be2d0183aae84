"""The stack config of spark-vllm: pydantic models of the whole `spark-vllm:` namespace and every rule it
must satisfy, checked before the first resource exists.

No I/O happens here: the models are filled from a plain dict (``load_cluster_config``), so the same
rules run under `pulumi up`, under Pulumi's mocks and in pure unit tests.

  types.py      value types, each with its own rule (names, addresses, paths, keys, secrets)
  sections.py   a node, and each object key (vllm, ray, fabric, container, …)
  models.py     ClusterConfig, the whole namespace, and what follows from it (head, workers, …)
  listeners.py  the ports each node's listeners take
  runner.py     how the cross-field rules run: each on the keys it declares, where they are valid
  rules.py      the cross-field rules
  errors.py     problems told as one line each; ConfigError
  key_paths.py  every key's path; pydantic's errors told at their key paths (unknown keys, secrets hidden)
  loading.py    load_cluster_config, and what the stack around the config can say
"""

from components.config.errors import ConfigError
from components.config.key_paths import config_keys
from components.config.listeners import (
    EPHEMERAL_KEY,
    EPHEMERAL_RANGE,
    RAY_CLIENT_KEY,
    RAY_CLIENT_PORT,
    Listener,
    node_listeners,
)
from components.config.loading import load_cluster_config, namespace_problems, near_namespace
from components.config.models import SECRET_KEYS, ClusterConfig, auto_executor
from components.config.sections import (
    BenchmarkConfig,
    ContainerConfig,
    FabricConfig,
    FabricCopyConfig,
    ImageTransferConfig,
    MemoryConfig,
    MetricsConfig,
    ModelSyncConfig,
    NcclConfig,
    NetworkConfig,
    NodeConfig,
    RayConfig,
    RecoveryConfig,
    ReleaseConfig,
    SecurityConfig,
    SpeculativeConfig,
    SshConfig,
    UlimitsConfig,
    VllmConfig,
)
from components.config.types import NAMESPACE

__all__ = [
    "EPHEMERAL_KEY", "EPHEMERAL_RANGE", "NAMESPACE", "RAY_CLIENT_KEY", "RAY_CLIENT_PORT", "SECRET_KEYS",
    "BenchmarkConfig", "ClusterConfig", "ConfigError", "ContainerConfig", "FabricConfig", "FabricCopyConfig",
    "ImageTransferConfig", "Listener", "MemoryConfig", "MetricsConfig", "ModelSyncConfig", "NcclConfig",
    "NetworkConfig", "NodeConfig", "RayConfig", "RecoveryConfig", "ReleaseConfig", "SecurityConfig",
    "SpeculativeConfig", "SshConfig", "UlimitsConfig", "VllmConfig", "auto_executor", "config_keys",
    "load_cluster_config", "namespace_problems", "near_namespace", "node_listeners",
]  # fmt: skip
