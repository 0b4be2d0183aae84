# Runs on a node's host over SSH as `bash -s` with this script on stdin (see
# components.netplan.netplan_apply_argv). Environment, set on the command line by the caller:
#   NETPLAN_PATH  the drop-in, e.g. /etc/netplan/40-spark-vllm-fabric.yaml
#   CONTENT_B64   base64 of the YAML (ACTION=apply)
#   SUDO          "" (root) or "sudo" / "sudo -n": prefix of every privileged command
#   ACTION        apply | remove
# apply writes the file (mode 600) only when its content differs and runs `netplan apply` only
# then; when `netplan apply` fails the previous file is put back so the next run tries again.
set -euo pipefail

: "${NETPLAN_PATH:?NETPLAN_PATH is required}" "${ACTION:?ACTION is required (apply or remove)}"
SUDO=${SUDO:-}

case $ACTION in
apply)
    : "${CONTENT_B64:?CONTENT_B64 is required for ACTION=apply}"
    want=$(printf '%s' "$CONTENT_B64" | base64 -d | sha256sum)
    want=${want%% *}
    have="" old_b64=""
    if $SUDO test -f "$NETPLAN_PATH"; then
        have=$($SUDO sha256sum "$NETPLAN_PATH")
        have=${have%% *}
        old_b64=$($SUDO base64 -w0 "$NETPLAN_PATH")
    fi
    if [[ $have == "$want" ]]; then
        if [[ $($SUDO stat -c %a "$NETPLAN_PATH") != 600 ]]; then
            $SUDO chmod 600 "$NETPLAN_PATH"
        fi
        echo "netplan: unchanged"
        exit 0
    fi
    dir=${NETPLAN_PATH%/*}
    tmp="$dir/.spark-vllm-netplan.$$"  # no .yaml suffix: netplan never reads it
    trap '$SUDO rm -f "$tmp"' EXIT
    $SUDO mkdir -p "$dir"
    printf '%s' "$CONTENT_B64" | base64 -d | $SUDO tee "$tmp" >/dev/null
    $SUDO chmod 600 "$tmp"
    $SUDO mv -f "$tmp" "$NETPLAN_PATH"
    if ! $SUDO netplan apply; then
        if [[ -n $old_b64 ]]; then
            printf '%s' "$old_b64" | base64 -d | $SUDO tee "$NETPLAN_PATH" >/dev/null
            echo "netplan: apply failed; restored the previous $NETPLAN_PATH" >&2
        else
            $SUDO rm -f "$NETPLAN_PATH"
            echo "netplan: apply failed; removed $NETPLAN_PATH again" >&2
        fi
        exit 1
    fi
    echo "netplan: written and applied"
    ;;
remove)
    if $SUDO test -e "$NETPLAN_PATH"; then
        $SUDO rm -f "$NETPLAN_PATH"
        $SUDO netplan apply
        echo "netplan: removed $NETPLAN_PATH"
    else
        echo "netplan: nothing to remove"
    fi
    ;;
*)
    echo "netplan: ACTION must be apply or remove, not '$ACTION'" >&2
    exit 2
    ;;
esac
