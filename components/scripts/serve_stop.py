# Runs inside a node's container through a quoted heredoc (`python3 - RUN_DIR GRACE`): takes vLLM's
# settings away from the supervisor, which stops vLLM (SIGTERM to its process group, GRACE
# seconds, then SIGKILL), and waits until it has. Safe to run when nothing runs.
import os
import sys

from components.scripts.node_contract import SupervisorStatus, VllmState
from components.scripts.node_timing import polls

RUN, GRACE = sys.argv[1], float(sys.argv[2])
SPEC, STATUS = f"{RUN}/spec.json", f"{RUN}/status.json"


def status():
    """What the supervisor says (node_contract.py SupervisorStatus), or nothing yet."""
    return SupervisorStatus.read(STATUS) or SupervisorStatus(node="", executor="", state=VllmState.UNKNOWN)


try:
    os.remove(SPEC)
except FileNotFoundError:
    print("vLLM has no settings here: nothing to stop")
    sys.exit(0)
pid = status().vllm_pid
for _ in polls(GRACE + 15, 0.5):
    now = status()
    if now.spec_fingerprint is None and not now.vllm_pid:
        print(f"vLLM (pid {pid}) stopped" if pid else "vLLM stopped")
        sys.exit(0)
print(f"the supervisor did not stop vLLM (pid {pid}) within {GRACE + 15:g} s")
sys.exit(1)
