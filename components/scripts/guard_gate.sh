# network.guard's gate (components/resources/steps.py service_container's guard_marker): the main process of a
# container of the stack that listens on a guarded port outside its node's container (the edge's own port,
# vllm-router's metrics, the copy depot) waits until the guard's container applied its rules in this boot, then
# becomes the container's program (`exec "$@"`). After a reboot Docker starts the node's containers at once: without
# it, those ports would answer anyone for the moments before the guard's rules are back. (The node's own containers
# wait in their supervisor: components/scripts/supervisor.py `guarded`.) Run as `bash -c "$(this)" guard_gate
# MARKER PROGRAM ARGS…`.
marker=$1
shift
boot=$(cat /proc/sys/kernel/random/boot_id)
trap 'exit 0' TERM INT
waited=0
until grep -qF "\"boot_id\": \"$boot\"" "$marker" 2>/dev/null; do
  if [ $((waited % 30)) -eq 0 ]; then
    echo "[spark-vllm] waiting for network.guard's rules in this boot (container spark-vllm.guard) before listening" >&2
  fi
  sleep 1 &
  wait $!
  waited=$((waited + 1))
done
echo "[spark-vllm] network.guard's rules are in place: starting" >&2
exec "$@"
