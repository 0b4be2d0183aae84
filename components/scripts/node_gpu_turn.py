# The node's GPU turn (the supervisor's, prepended to it by components.render.SCRIPT_HELPERS): vLLM sizes its KV
# cache by profiling, counting every change of the GPU's used memory while it starts as its own, so two vLLMs
# starting at once on one GPU each count the other's (vLLM issue 55827): one refuses ("No available memory for
# the cache blocks"), the other takes more than its gpuMemoryUtilization. So a supervisor starts vLLM only while
# it holds the node's turn, and holds it until vLLM serves or exits.
#
# The turn is an abstract Unix socket (`@spark-vllm-gpu-turn`): its namespace is the network namespace, which
# every container of the stack shares with the host (host networking), so one name is one lock a node, with no
# file or mount in any container; the kernel frees it the moment its holder dies (a SIGKILL, a container
# stopped, a reboot). The holder listens on it and answers who it is, so a waiting supervisor can say who holds
# the turn. SPARK_VLLM_GPU_TURN names another turn (tests running several "nodes" on one host).
# Standard library only, no side effects.
import errno
import json
import os
import socket
import time

TURN_NAME = "spark-vllm-gpu-turn"


class GpuTurn:
    def __init__(self):
        self.name = "\0" + (os.environ.get("SPARK_VLLM_GPU_TURN") or TURN_NAME)
        self.identity = {}  # what a waiting supervisor is told: node, replica, why, since when
        self.socket = None
        self.since = None  # monotonic time it was taken

    @property
    def held(self):
        return self.socket is not None

    def take(self, identity):
        """Whether this supervisor holds the turn now (taken, or already held); `identity` is what it answers."""
        if self.socket is not None:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
        except OSError as error:
            sock.close()
            if error.errno == errno.EADDRINUSE:
                return False
            raise
        sock.listen(8)
        sock.setblocking(False)
        self.socket, self.since = sock, time.monotonic()
        self.identity = {**identity, "taken": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return True

    def answer(self):
        """Tells each supervisor that asked who holds the turn (called from the holder's loop)."""
        if self.socket is None:
            return
        while True:
            try:
                peer, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                peer.settimeout(1)
                peer.sendall((json.dumps(self.identity) + "\n").encode())
            except OSError:
                pass
            finally:
                peer.close()

    def holder(self, timeout=1.5):
        """Who holds the turn ({} when it cannot tell, None when nobody does)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.name)
            with sock.makefile("rb") as answer:
                return json.loads(answer.readline().decode() or "{}")
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        except (OSError, ValueError):
            return {}
        finally:
            sock.close()

    def give_back(self):
        if self.socket is not None:
            self.socket.close()
        self.socket, self.since = None, None


def describe_holder(holder):
    """`coder (node spark-03) since 12:01:02, starting vLLM` from what a holder answered."""
    if not holder:
        return "another supervisor on this node"
    who = holder.get("replica") or "a single-model stack's vLLM"
    return f"{who} (node {holder.get('node', '?')}) since {holder.get('taken', '?')}, {holder.get('why', 'starting')}"
