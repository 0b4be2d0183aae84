# Runs on a node's HOST over SSH as `bash -s` with this script on stdin (see
# components.preflight.preflight_argv). Environment, set on the command line by the caller:
#   NODE         node name (for messages)
#   FABRIC_IF    fabric interface, e.g. enp1s0f1np1
#   FABRIC_ADDR  this node's fabric IPv4 address
#   PEERS        space-separated fabric addresses of the other nodes; NAME=ADDR names them in messages
#   MODEL        absolute model path, or empty when the model is a repo id
#   CONTAINER    this stack's container on the node (its vLLM holds the GPU while it runs)
#   FABRIC_CHECKS 0 when the fabric gate (node_fabric_gate.py) checks the link instead: the interface and
#                the peers are then left to it; 1 (the default) checks them here
# Runs every check; each problem is one line on stderr, `preflight NODE: what is wrong — what to do`.
# Exit 0 and `preflight NODE: ok` on stdout when all pass, 1 otherwise; then, on its own line, the
# node's memory as JSON for the memory plan: {"mem_total_bytes": N, "mem_available_bytes": N,
# "gpu_memory_mib": [per GPU, or "[N/A]" where the GPU shares system memory, as on a GB10],
# "gpu_free_mib": [per GPU, likewise], "stack_running": whether CONTAINER runs (its vLLM's memory is not
# free now, but will be when it is replaced)}. Needs bash, iproute2, coreutils; ping (iputils) and
# nvidia-smi when present.
set -u

for var in NODE FABRIC_IF FABRIC_ADDR; do
    if [[ -z ${!var:-} ]]; then
        echo "preflight: $var is not set — the caller must set NODE, FABRIC_IF and FABRIC_ADDR" >&2
        exit 2
    fi
done
PEERS=${PEERS:-}
MODEL=${MODEL:-}
FABRIC_CHECKS=${FABRIC_CHECKS:-1}
failed=0

fail() {
    printf 'preflight %s: %s — %s\n' "$NODE" "$1" "$2" >&2
    failed=1
}

warn() {
    printf 'preflight %s: warning: %s\n' "$NODE" "$1" >&2
}

# Interfaces carrying $FABRIC_ADDR, one a line, from `ip -o -4 addr show` output on stdin.
interfaces_with_address() {
    local _ ifname cidr
    while read -r _ ifname _ cidr _; do
        [[ ${cidr%/*} == "$FABRIC_ADDR" ]] && echo "$ifname"
    done
    return 0
}

# --- the fabric interface: exists, up, carries the fabric address ---------------------------------
if [[ $FABRIC_CHECKS == 1 ]]; then
link=$(ip -o link show dev "$FABRIC_IF" 2>/dev/null) || link=""
elsewhere=$(ip -o -4 addr show 2>/dev/null | interfaces_with_address)
elsewhere=${elsewhere//$'\n'/, }
if [[ -z $link ]]; then
    if [[ -n $elsewhere ]]; then
        hint="$FABRIC_ADDR is on $elsewhere: set nodes[].fabricInterface to that interface"
    else
        hint="check nodes[].fabricInterface (\`ip -br link\` lists the interfaces)"
    fi
    fail "fabric interface $FABRIC_IF does not exist" "$hint"
else
    flags="" state=""
    [[ $link =~ \<([^>]*)\> ]] && flags=",${BASH_REMATCH[1]},"
    [[ $link =~ \ state\ ([A-Za-z_]+) ]] && state=${BASH_REMATCH[1]}
    if [[ $state == UP || ($flags == *,UP,* && $flags == *,LOWER_UP,*) ]]; then
        :
    elif [[ $flags == *,UP,* ]]; then
        fail "fabric interface $FABRIC_IF is up but has no link (no carrier)" \
            "check the cable and that the peer's port is up"
    else
        fail "fabric interface $FABRIC_IF is down" \
            "bring it up (\`ip link set dev $FABRIC_IF up\`) or let the program manage it (network.manage: true)"
    fi
    mine=$(ip -o -4 addr show dev "$FABRIC_IF" 2>/dev/null | interfaces_with_address)
    if [[ -z $mine ]]; then
        if [[ -n $elsewhere ]]; then
            fail "fabric address $FABRIC_ADDR is on $elsewhere, not on $FABRIC_IF" \
                "set nodes[].fabricInterface to $elsewhere, or move the address to $FABRIC_IF"
        else
            fail "fabric address $FABRIC_ADDR is not configured on $FABRIC_IF" \
                "add it (network.manage: true writes a netplan drop-in) or correct nodes[].fabricAddress"
        fi
    fi
fi

# --- every peer through the fabric interface ------------------------------------------------------
have_ping=0
command -v ping >/dev/null 2>&1 && have_ping=1
if [[ -n $PEERS && $have_ping == 0 ]]; then
    warn "ping not found: checked only that the route to each peer leaves through $FABRIC_IF, not that the peer answers"
fi
for token in $PEERS; do
    if [[ $token == *=* ]]; then
        peer=${token#*=} label="${token%%=*} ($peer)"
    else
        peer=$token label="peer $peer"
    fi
    [[ $peer == "$FABRIC_ADDR" ]] && continue
    what="cannot reach $label via $FABRIC_IF (from $FABRIC_ADDR)"
    route=$(ip route get "$peer" 2>&1) || {
        fail "$what: no route (${route%%$'\n'*})" \
            "all fabric addresses must share the fabric subnet (network.prefixLength) on $FABRIC_IF"
        continue
    }
    if [[ " ${route//$'\n'/ } " != *" dev $FABRIC_IF "* ]]; then
        dev=""
        [[ $route =~ \ dev\ ([^ ]+) ]] && dev=${BASH_REMATCH[1]}
        fail "$what: the route goes through ${dev:-another interface}" \
            "all fabric addresses must share the fabric subnet (network.prefixLength) on $FABRIC_IF"
        continue
    fi
    if [[ $have_ping == 1 ]] && ! ping -c 1 -W 2 -I "$FABRIC_IF" "$peer" >/dev/null 2>&1; then
        fail "$what: no answer to ping" \
            "check the cable, that $FABRIC_IF is up on both nodes and the peer's fabricAddress (or a firewall dropping ICMP)"
    fi
done
fi

# --- Docker answers -------------------------------------------------------------------------------
if ! command -v docker >/dev/null 2>&1; then
    fail "docker not found" "install Docker on the node"
else
    errfile=$(mktemp)
    version=$(timeout 30 docker info --format '{{.ServerVersion}}' 2>"$errfile")
    rc=$?
    err=$(<"$errfile")
    rm -f "$errfile"
    if [[ $rc == 124 ]]; then
        fail "Docker did not answer within 30 s" "check the daemon (\`systemctl status docker\`)"
    elif [[ $rc != 0 || -z $version ]]; then
        err=${err%%$'\n'*}
        fail "Docker does not answer (${err:-no server version})" \
            "start it (\`systemctl start docker\`) and let user $(id -un) use it (root or the docker group)"
    fi
fi

# --- the model directory --------------------------------------------------------------------------
if [[ -n $MODEL ]]; then
    if [[ ! -e $MODEL ]]; then
        fail "model directory $MODEL does not exist" \
            "copy the model to the same path on every node, or set model to a Hugging Face repo id"
    elif [[ ! -d $MODEL ]]; then
        fail "model path $MODEL is not a directory" "point model at the directory that holds config.json"
    elif [[ ! -r $MODEL || ! -x $MODEL ]]; then
        fail "model directory $MODEL is not readable by $(id -un)" "make it readable (\`chmod -R a+rX $MODEL\`)"
    elif [[ ! -f $MODEL/config.json ]]; then
        fail "model directory $MODEL has no config.json" \
            "point model at the directory with config.json and the weights (in a HF cache: …/snapshots/<revision>)"
    elif [[ ! -r $MODEL/config.json ]]; then
        fail "$MODEL/config.json is not readable by $(id -un)" "make it readable (\`chmod -R a+rX $MODEL\`)"
    fi
fi

if [[ $failed == 0 ]]; then
    echo "preflight $NODE: ok"
    mem_kb=0 available_kb=0
    while read -r key value _; do
        [[ $key == MemTotal: ]] && mem_kb=$value
        [[ $key == MemAvailable: ]] && available_kb=$value
    done < /proc/meminfo
    gpus="" free=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        while IFS=, read -r total left; do
            gpus+="${gpus:+,}\"${total//[^0-9A-Za-z.\[\]\/]/}\""
            free+="${free:+,}\"${left//[^0-9A-Za-z.\[\]\/]/}\""
        done < <(timeout 30 nvidia-smi --query-gpu=memory.total,memory.free --format=csv,noheader,nounits 2>/dev/null)
    fi
    running=false
    if [[ -n ${CONTAINER:-} ]] && [[ $(docker inspect -f '{{.State.Running}}' "$CONTAINER" 2>/dev/null) == true ]]; then
        running=true
    fi
    printf '{"mem_total_bytes": %s, "mem_available_bytes": %s, "gpu_memory_mib": [%s], "gpu_free_mib": [%s], "stack_running": %s}\n' \
        "$(( mem_kb * 1024 ))" "$(( available_kb * 1024 ))" "$gpus" "$free" "$running"
fi
exit "$failed"
