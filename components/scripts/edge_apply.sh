# The edge's configuration step (components/resources/edge.py), run by bash inside the edge's container
# (`docker exec -u 0 -i spark-vllm.edge bash -c "$(this)" edge_apply`), the new configuration on stdin: a tar, in
# base64, of haproxy.cfg and the files it names (named by their content: the certificate and key with `tls`, the
# counters' Lua). The files are made the edge's user's alone (mode 0600: they hold the program's key and the TLS
# key); haproxy.cfg is checked with HAProxy itself before anything changes, put in place, and the running HAProxy
# reloads it (master-worker: SIGUSR2 to the master, whose pid edge_entry.sh keeps in /tmp; the old worker
# finishes what it serves), the signal sent again until a new worker is there (one sent while HAProxy is still
# starting is lost); then the step waits until the edge answers its own check at the configuration's first `bind`
# (the edge's own port, as edge_entry.sh asks it), and removes the files no configuration names any more.
# The official haproxy image has bash, tar and base64, no curl.
set -euo pipefail
dir=${EDGE_DIR:-/etc/spark-vllm-edge}
cfg=$dir/haproxy.cfg
owner=$(stat -c %u:%g /proc/1) # the user the container (HAProxy) runs as

incoming=$(mktemp -d "$dir/.incoming.XXXXXX")
trap 'rm -rf "$incoming"' EXIT
base64 -d | tar -x -C "$incoming" --no-same-owner --no-same-permissions
for file in "$incoming"/*; do
  chown "$owner" "$file"
  chmod 0600 "$file"
done
for file in "$incoming"/*; do # named by their content: one of the same name is the same file
  name=${file##*/}
  [ "$name" = haproxy.cfg ] || mv -f "$file" "$dir/$name"
done
mv -f "$incoming/haproxy.cfg" "$cfg.new"

tidy() { # the files neither haproxy.cfg names (a reload's old worker read its own at its start)
  local file
  for file in "$dir"/counters-*.lua "$dir"/tls-*.pem; do
    [ -e "$file" ] || continue
    grep -qF "${file##*/}" "$cfg" 2>/dev/null || rm -f "$file"
  done
}

if ! haproxy -c -q -f "$cfg.new"; then
  echo "edge: HAProxy refuses the configuration (above)" >&2
  rm -f "$cfg.new"
  tidy
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
tidy

read -r address port < <(sed -n 's/^[[:space:]]*bind[[:space:]]\{1,\}\([0-9.]*\):\([0-9]*\).*/\1 \2/p' "$cfg" | head -n 1)
[ "$address" = 0.0.0.0 ] && address=127.0.0.1
deadline=$((SECONDS + 30))
while [ "$SECONDS" -lt "$deadline" ]; do
  # the connection included within 5 s: a listener whose queue is full leaves a connect waiting for minutes
  line=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "GET /spark-vllm-edge/alive HTTP/1.0\r\n\r\n" >&3; IFS= read -r line <&3; printf "%s" "$line"' \
    alive "$address" "$port" 2>/dev/null || true)
  case "$line" in HTTP/1.?\ 200*)
    echo "edge: answering on its own port $address:$port"
    exit 0
    ;;
  esac
  sleep 0.2
done
echo "edge: nothing answers on its own port $address:$port" >&2
exit 1
