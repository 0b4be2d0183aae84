# The edge container's main process (components/resources/edge.py), run by bash as PID 1:
# `bash -c "$(this)" edge_entry INTERVAL MISSES`. It waits for the first configuration (a new volume has none;
# spark-vllm-edge-config writes it), runs HAProxy beside itself (master-worker: -W, its master's pid in
# /tmp/spark-vllm-edge.pid for the reloads: the volume is root's and HAProxy runs as the image's user; its log
# on stdout), and watches it: every INTERVAL seconds one HTTP
# request to the edge itself, answered by HAProxy without the upstream (edge.py ALIVE_PATH, from this host
# only). After MISSES in a row without an answer (a listener that accepts and never answers, a worker stopped
# or stuck) it ends HAProxy and exits non-zero, and Docker's restart policy starts the edge anew. HAProxy
# exiting ends it too. `docker stop` (SIGTERM) stops HAProxy and exits 0.
set -u
interval=$1
misses_allowed=$2
dir=${EDGE_DIR:-/etc/spark-vllm-edge}
cfg=$dir/haproxy.cfg
pidfile=${EDGE_PIDFILE:-/tmp/spark-vllm-edge.pid}
say() { echo "[spark-vllm edge] $(date -u +%H:%M:%S) $*" >&2; }

stopping=no
trap 'stopping=yes' TERM INT
while [ ! -s "$cfg" ]; do
  [ "$stopping" = yes ] && exit 0
  sleep 0.5
done

haproxy -W -db -p "$pidfile" -f "$cfg" &
haproxy_pid=$!
trap 'kill -TERM "$haproxy_pid" 2>/dev/null; wait "$haproxy_pid"; exit 0' TERM INT

answers() { # one request to the edge's own listener (the configuration's bind address, loopback for 0.0.0.0),
  # the connection included within 5 s (a listener whose queue is full leaves a connect waiting for minutes)
  local bind address port line
  bind=$(sed -n 's/^[[:space:]]*bind[[:space:]]\{1,\}\([0-9.]*\):\([0-9]*\).*/\1 \2/p' "$cfg" | head -n 1)
  read -r address port <<<"$bind"
  [ "$address" = 0.0.0.0 ] && address=127.0.0.1
  line=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "GET /spark-vllm-edge/alive HTTP/1.0\r\n\r\n" >&3; IFS= read -r line <&3; printf "%s" "$line"' \
    alive "$address" "$port" 2>/dev/null)
  case "$line" in HTTP/1.?\ 200*) return 0 ;; *) return 1 ;; esac
}

missed=0
while kill -0 "$haproxy_pid" 2>/dev/null; do
  sleep "$interval" &
  wait $!
  kill -0 "$haproxy_pid" 2>/dev/null || break
  if answers; then
    missed=0
    continue
  fi
  missed=$((missed + 1))
  say "no answer from the edge's own check ($missed of $misses_allowed)"
  if [ "$missed" -ge "$misses_allowed" ]; then
    say "HAProxy takes connections and answers none: ending it; Docker starts the edge again"
    kill -KILL "$haproxy_pid" 2>/dev/null
    exit 1
  fi
done
wait "$haproxy_pid"
code=$?
say "HAProxy exited ($code)"
exit "$code"
