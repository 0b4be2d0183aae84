# Runs inside a node's container (`docker exec -i … python3 -`), its parameters in the
# program (node_params.py). Hands vLLM's settings to the container's supervisor
# (components/scripts/supervisor.py) and waits until it has taken them up:
#
# * the same settings already running: nothing changes ("already running with these settings");
# * other settings (or none yet): RUN_DIR/spec.json is replaced (mode 600: it carries the API key),
#   the supervisor stops the old vLLM and starts the new one;
# * the supervisor reports failure (vLLM keeps exiting, or refused these settings): its reason and the
#   log tail, and still exit 0, so the state holds what the node holds; the readiness step then fails.
# RUN_DIR/watch.json (what the supervisor watches while vLLM serves: stallSeconds, canarySeconds) is written
# every time, before spec.json; it is not part of the settings' fingerprint, so changing it restarts nothing.
#
# Re-running it is safe: a changed SSH credential re-runs every remote command, and this one then
# leaves a running vLLM alone.
import json
import os
import sys

from components.scripts.node_contract import HandoverParams, HandoverResult, SupervisorStatus, VllmSpec, VllmState
from components.scripts.node_params import given
from components.scripts.node_timing import polls

P = HandoverParams.from_json(given())
RUN = P.run_dir
SPEC, STATUS, LOG, WATCH = f"{RUN}/spec.json", f"{RUN}/status.json", f"{RUN}/vllm.log", f"{RUN}/watch.json"


def read(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def tail(lines):
    try:
        with open(LOG, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return "(no log)\n"


def write_private(path, data):
    """`path` replaced at once, readable by root alone (spec.json carries the API key)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def keep_node_specific_env():
    """With Ray: vLLM copies the driver's NCCL_*/UCX_*/VLLM_* values to every worker unless they are listed in
    VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json; listed, each node keeps its own interface names, and
    the API key stays with the API server (components/plan/serving.py HEAD_ONLY_ENV)."""
    root = P.env.get("VLLM_CONFIG_ROOT")
    if not root or not P.ray_non_carry_over:
        return
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "ray_non_carry_over_env_vars.json")
    with open(f"{path}.tmp", "w") as handle:
        json.dump(sorted(P.ray_non_carry_over), handle)
    os.replace(f"{path}.tmp", path)


def main():
    os.makedirs(RUN, mode=0o700, exist_ok=True)
    keep_node_specific_env()
    current = read(SPEC)
    unchanged = bool(current) and current.get("fingerprint") == P.fingerprint
    if P.watch is not None:  # first: a supervisor starting vLLM with new settings watches it as it should
        write_private(WATCH, P.watch.to_json())
    if not unchanged:
        write_private(SPEC, VllmSpec(argv=P.argv, env=P.env, fingerprint=P.fingerprint, **vars(P.spec)).to_json())
    for _ in polls(P.timeout_seconds, 0.5):
        status = SupervisorStatus.read(STATUS) or SupervisorStatus(node=P.node, executor="", state=VllmState.UNKNOWN)
        if status.spec_fingerprint == P.fingerprint:
            if status.failed:
                # Handed over all the same: the step records these settings, so the next `up` with the
                # settings mended changes them again (a failed step would keep the previous ones in the
                # state, and mending them back would then change nothing). The readiness step stops
                # `pulumi up` with the supervisor's reason.
                print(f"settings handed over, but vLLM on {P.node} does not start: {status.failed}")
                print(f"--- last 60 lines of {LOG} ---")
                print(tail(60))
                print(json.dumps(HandoverResult(vllm_pid=None, fingerprint=P.fingerprint).to_json()))
                return 0
            if status.vllm_pid:
                if unchanged:
                    print(f"vLLM already running with these settings (pid {status.vllm_pid})")
                else:
                    print(f"vLLM started (pid {status.vllm_pid}); log: {LOG}")
                print(json.dumps(HandoverResult(vllm_pid=status.vllm_pid, fingerprint=P.fingerprint).to_json()))
                return 0
            if status.state == VllmState.WAITING_RAY:
                print(f"settings handed over; vLLM starts once Ray shows every node ({P.node})")
                print(json.dumps(HandoverResult(vllm_pid=None, fingerprint=P.fingerprint).to_json()))
                return 0
            if status.state == VllmState.WAITING_TURN:
                # another replica on this node is starting: this one starts after it (the readiness step waits)
                held = (status.turn or "").replace("waiting: ", "")
                print(f"settings handed over; vLLM starts on {P.node} once the node's GPU turn is free ({held})")
                print(json.dumps(HandoverResult(vllm_pid=None, fingerprint=P.fingerprint).to_json()))
                return 0
    print(
        f"the supervisor in this container did not take up the settings within {P.timeout_seconds} s "
        f"(status: {read(STATUS)}); its output: `docker logs` of the container"
    )
    return 1


sys.exit(main())
