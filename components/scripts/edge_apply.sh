# The edge's configuration step (components/resources/edge.py), run by bash inside the edge's container
# (`docker exec -u 0 -i spark-vllm.edge bash -c "$(this)" edge_apply ADDRESS PORT`), the new haproxy.cfg on
# stdin. It checks it with HAProxy itself before anything changes, puts it in place, and has the running
# HAProxy reload it (master-worker: SIGUSR2 to the master, whose pid edge_entry.sh keeps in /tmp; the old
# worker finishes what it serves), sending the signal again until a new worker is there (one sent while HAProxy
# is still starting is lost); then it waits until the endpoint answers an HTTP request. The official haproxy
# image has bash, no curl.
set -euo pipefail
address=$1
port=$2
dir=${EDGE_DIR:-/etc/spark-vllm-edge}
cfg=$dir/haproxy.cfg

cat >"$cfg.new"
chmod 0644 "$cfg.new"
if ! haproxy -c -q -f "$cfg.new"; then
  echo "edge: HAProxy refuses the configuration (above)" >&2
  rm -f "$cfg.new"
  exit 1
fi

master=$(cat "${EDGE_PIDFILE:-/tmp/spark-vllm-edge.pid}" 2>/dev/null || true)
workers() { # HAProxy's workers: the master's children
  local stat pid comm state ppid rest
  for stat in /proc/[0-9]*/stat; do
    read -r pid comm state ppid rest <"$stat" 2>/dev/null || continue
    if [ "$ppid" = "$master" ]; then echo "$pid"; fi
  done
}

running=no
if [ -n "$master" ] && kill -0 "$master" 2>/dev/null; then running=yes; fi
if [ "$running" = yes ] && cmp -s "$cfg.new" "$cfg"; then
  rm -f "$cfg.new"
  echo "edge: configuration unchanged"
else
  before=" $(workers | tr '\n' ' ')"
  mv "$cfg.new" "$cfg"
  if [ "$running" = yes ]; then
    reloaded=no
    for _ in 1 2 3 4 5 6; do
      kill -USR2 "$master"
      for _ in $(seq 50); do
        for pid in $(workers); do
          case "$before" in *" $pid "*) ;; *) reloaded=yes ;; esac
        done
        [ "$reloaded" = yes ] && break 2
        sleep 0.1
      done
    done
    [ "$reloaded" = yes ] || { echo "edge: HAProxy did not reload within 30 s" >&2; exit 1; }
    echo "edge: configuration reloaded"
  else
    echo "edge: configuration written; HAProxy starts with it"
  fi
fi

target=$address
[ "$target" = 0.0.0.0 ] && target=127.0.0.1
deadline=$((SECONDS + 30))
while [ "$SECONDS" -lt "$deadline" ]; do # any HTTP answer to GET /health (the upstream may still be starting: 503)
  # the connection included within 5 s: a listener whose queue is full leaves a connect waiting for minutes
  line=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "GET /health HTTP/1.0\r\nHost: spark-vllm-edge\r\n\r\n" >&3; IFS= read -r line <&3; printf "%s" "$line"' \
    health "$target" "$port" 2>/dev/null || true)
  case "$line" in HTTP/1.*)
    echo "edge: answering on $address:$port (${line%$'\r'})"
    exit 0
    ;;
  esac
  sleep 0.2
done
echo "edge: nothing answers on $address:$port" >&2
exit 1
