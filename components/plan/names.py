"""Names, paths, volumes and timeouts shared by the program's rooms and the scripts it renders: one place
for each, so a container's mount and the script that reads it cannot drift apart."""

from __future__ import annotations

CONTAINER_PREFIX = "spark-vllm"
HF_CACHE_VOLUME = "spark-vllm-hf-cache"
HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface"
# container.compileCache: the caches that carry a new container's first start (volume, path in the container)
COMPILE_CACHE_VOLUMES = (
    ("spark-vllm-compile-cache", "/root/.cache/vllm"),  # vllm/envs.py VLLM_CACHE_ROOT's default
    ("spark-vllm-flashinfer-cache", "/root/.cache/flashinfer"),  # FlashInfer's JIT cache, under the home
)
# network.guard's marker (its volume, read-only in every node's container): the supervisor starts
# Ray only once the guard applied its rules in this boot.
GUARD_VOLUME = "spark-vllm-guard"
GUARD_MARKER_DIR_IN_NODE = "/run/spark-vllm-guard"
GUARD_MARKER_IN_NODE = f"{GUARD_MARKER_DIR_IN_NODE}/applied.json"
# The node's GPU turn (components/scripts/node_gpu_turn.py): a volume every node container of the stack mounts, so
# the node's supervisors share it and nobody else on the node can reach it (Docker keeps it root's, 0755).
GPU_TURN_VOLUME = "spark-vllm-gpu-turn"
GPU_TURN_DIR_IN_NODE = "/run/spark-vllm-turn"
# The router's container: vllm-router installed once per version where the image lacks it (a volume)
ROUTER_INSTALL_DIR = "/opt/spark-vllm-router"
# Who runs the edge and the router (their containers' `user`), so that network.guard can let these two alone reach
# vllm-router's port on loopback, whose admin API has no authentication: the edge as the official haproxy image's
# own user (uid 99), the router's keeper as root.
EDGE_USER_ID = 99
ROUTER_USER_ID = 0
RUN_DIR = "/run/spark-vllm"  # inside every node's container: vLLM's settings, log and the supervisor's status
SUPERVISOR_IN_CONTAINER = "/opt/spark-vllm/supervisor.py"  # supervisor_boot.py runs what is installed here
VLLM_LOG = f"{RUN_DIR}/vllm.log"
STATUS_FILE = f"{RUN_DIR}/status.json"
# The benchmark's pid while it measures: the supervisor asks no canary meanwhile (node_vllm_watch.py), whose tokens
# would count in the load's figures (MTP's acceptance, read from vLLM's counters)
MEASURING_FILE = f"{RUN_DIR}/measuring"
# Grace period for vLLM to release GPU memory and Ray placement groups on SIGTERM.
VLLM_STOP_GRACE_SECONDS = 30
POLL_SECONDS = 1  # the waits notice a ready server (or a joined node) within this
PROGRESS_SECONDS = 30
SILENT_SECONDS = 60  # vLLM's log silent this long: the readiness progress says which long step it is in
SERVE_HANDOVER_SECONDS = 120  # for a supervisor to take up new settings (stopping the old vLLM first)
SMOKE_PROMPT = "Reply with the single word: ready"
SMOKE_MAX_TOKENS = 16
SMOKE_TIMEOUT_SECONDS = 120
