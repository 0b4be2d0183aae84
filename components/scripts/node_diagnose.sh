#!/usr/bin/env bash
# Collects what a node can say about the stack, for scripts/diagnose.py (over SSH, this script on stdin).
# Every section is printed between `=== spark-vllm-diagnose: FILE ===` lines; each command is bounded by a
# timeout and may fail without stopping the others. Environment: CONTAINERS (this node's container names,
# space separated), VLLM_CONTAINERS (those that run vLLM; default: the first of CONTAINERS), RUN_DIR (inside
# the container), FABRIC_IF.
set -u
section() { printf '\n=== spark-vllm-diagnose: %s ===\n' "$1"; }
run() { timeout --kill-after=5 "${LIMIT:-30}" "$@" 2>&1 || echo "(exit $?: $*)"; }
sudo_n() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi; }

section host.txt
run uname -a
run uptime
run cat /etc/os-release
section meminfo.txt
run grep -E '^(MemTotal|MemFree|MemAvailable|SwapTotal|SwapFree|Cached):' /proc/meminfo
section nvidia-smi.txt
run nvidia-smi
run nvidia-smi --query-gpu=index,name,memory.total,memory.used,memory.free,temperature.gpu --format=csv
section kernel.txt
# NVRM (the driver), Xid (GPU faults), the OOM killer: the kernel's own lines, from dmesg or the journal
{ sudo_n dmesg -T 2>/dev/null || sudo_n journalctl -k --no-pager -n 5000 2>/dev/null || echo "(no dmesg or journal readable)"; } \
  | grep -iE 'NVRM|Xid|oom|out of memory|killed process|hung task' | tail -n 200
section containers.txt
run docker ps -a --filter label=spark-vllm.role --filter name=spark-vllm --format '{{.Names}}\t{{.Image}}\t{{.Status}}\t{{.RunningFor}}'
section images.txt
run docker images --digests --format '{{.Repository}}:{{.Tag}}\t{{.ID}}\t{{.Digest}}\t{{.Size}}'
for container in ${CONTAINERS:-}; do
  # The container's state and image, never its environment (it holds the tokens)
  section "container-$container.txt"
  run docker inspect -f 'image {{.Image}}; state {{.State.Status}} since {{.State.StartedAt}}; exit {{.State.ExitCode}}; restarted {{.RestartCount}} time(s); oom-killed {{.State.OOMKilled}}' "$container"
  section "docker-logs-$container.txt"
  run docker logs --tail 300 "$container"
done
# vLLM's own sections, per container that runs one (with deployments, each replica's on this node); one such
# container keeps the plain names (status.json, vllm-log.txt, …), several are told apart by their name
vllm_containers=${VLLM_CONTAINERS:-${CONTAINERS%% *}}
count=$(echo "$vllm_containers" | wc -w)
for container in $vllm_containers; do
  suffix=""
  [ "$count" -gt 1 ] && suffix="-$container"
  section "status$suffix.json"
  run docker exec "$container" cat "$RUN_DIR/status.json"
  section "fault$suffix.txt"
  # what vLLM's processes were doing when the supervisor last ended one that answered /health (stalled, wrong)
  run docker exec "$container" sh -c "cat '$RUN_DIR/fault.txt' 2>/dev/null || echo '(none ended for a fault)'"
  section "vllm-log$suffix.txt"
  run docker exec "$container" tail -n 400 "$RUN_DIR/vllm.log"
  section "nccl$suffix.txt"
  # NCCL's transport lines: NET/IB means RDMA, NET/Socket a TCP fallback
  run docker exec "$container" grep -hE 'NCCL INFO .*(NET/|via |Using network|NCCL_IB|Channel 00)' "$RUN_DIR/vllm.log" | tail -n 100
  section "ray-status$suffix.txt"
  LIMIT=40 run docker exec "$container" sh -c 'command -v ray >/dev/null && ray status || echo "(no ray in this container: executor mp)"'
done
section fabric.txt
if [ -n "${FABRIC_IF:-}" ]; then
  run ip -d addr show dev "$FABRIC_IF"
  run cat "/sys/class/net/$FABRIC_IF/speed" "/sys/class/net/$FABRIC_IF/mtu"
fi
run sh -c 'ls /sys/class/infiniband 2>/dev/null && for d in /sys/class/infiniband/*/ports/*/state; do echo "$d: $(cat "$d")"; done'
