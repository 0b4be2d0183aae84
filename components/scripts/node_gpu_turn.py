# The node's GPU turn (the supervisor's, prepended to it by components.plan.programs.SCRIPT_HELPERS): vLLM sizes its KV
# cache by profiling, counting every change of the GPU's used memory while it starts as its own, so two vLLMs
# starting at once on one GPU each count the other's (vLLM issue 55827): one refuses ("No available memory for
# the cache blocks"), the other takes more than its gpuMemoryUtilization. So a supervisor starts vLLM only while
# it holds the node's turn, and holds it until vLLM serves or exits.
#
# The turn is an abstract Unix socket (`@spark-vllm-gpu-turn`): its namespace is the network namespace, which
# every container of the stack shares with the host (host networking), so one name is one lock a node, with no
# file or mount in any container; the kernel frees it the moment its holder dies (a SIGKILL, a container
# stopped, a reboot). The holder listens on it and answers who it is, so a waiting supervisor can say who holds
# the turn. Each supervisor also answers, on a name of its own (`@spark-vllm-gpu-turn.tenant.<replica>.<random>`),
# what its vLLM asks of the GPU and how it is doing: a supervisor finds its neighbours in /proc/net/unix (the
# network namespace's sockets) and can name them when the GPU's memory is theirs. SPARK_VLLM_GPU_TURN names
# another turn (tests running several "nodes" on one host). Standard library only, no side effects.
import errno
import json
import os
import secrets
import socket
import struct
import time

TURN_NAME = "spark-vllm-gpu-turn"


class GpuTurn:
    def __init__(self):
        self.listener = Listener("\0" + (os.environ.get("SPARK_VLLM_GPU_TURN") or TURN_NAME))
        self.since = None  # monotonic time it was taken

    @property
    def held(self):
        return self.listener.socket is not None

    def take(self, identity):
        """Whether this supervisor holds the turn now (taken, or already held); `identity` is what it answers."""
        if self.held:
            return True
        if not self.listener.open():
            return False
        self.since = time.monotonic()
        self.listener.identity = {**identity, "taken": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return True

    def answer(self):
        """Tells each supervisor that asked who holds the turn (called from the holder's loop)."""
        self.listener.answer()

    def holder(self):
        """Who holds the turn ({} when it cannot tell, None when nobody does)."""
        return ask(self.listener.name)

    def give_back(self):
        self.listener.close()
        self.since = None


class Listener:
    """A listening abstract socket that answers each connection with one JSON line (`identity`)."""

    def __init__(self, name):
        self.name = name
        self.identity = {}
        self.socket = None

    def open(self):
        """Whether it listens now (False: the name is taken)."""
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
        self.socket = sock
        return True

    def answer(self):
        if self.socket is None:
            return
        while True:
            try:
                peer, _ = self.socket.accept()
            except OSError:  # nobody asking (BlockingIOError), or the socket gone
                return
            try:
                peer.settimeout(1)
                peer.sendall((json.dumps(self.identity) + "\n").encode())
            except OSError:
                pass
            finally:
                peer.close()

    def close(self):
        if self.socket is not None:
            self.socket.close()
        self.socket = None


def ask(name, timeout=1.5):
    """What the abstract socket `name` answers: a mapping (None: nobody listens there; {}: no answer, or one that is
    not a mapping). An abstract name has no permissions: any process in the host's network namespace may bind one.
    A listener of another user than this supervisor's (the stack's own run as root) is not believed: its answer is
    {"impostor": {"pid", "uid"}}, what the kernel says of it (SO_PEERCRED), never what it says of itself."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(name)
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.geteuid():
            return {"impostor": {"pid": pid, "uid": uid}}
        with sock.makefile("rb") as answer:
            found = json.loads(answer.readline(65536).decode() or "{}")
        return found if isinstance(found, dict) else {}
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    except (OSError, ValueError):
        return {}
    finally:
        sock.close()


class Tenant:
    """This supervisor as its neighbours on the node see it, and the neighbours as it sees them."""

    def __init__(self):
        self.prefix = "\0" + (os.environ.get("SPARK_VLLM_GPU_TURN") or TURN_NAME) + ".tenant."
        self.listener = None

    def tell(self, identity):
        """What this supervisor answers now (its replica, its share of the GPU, its state)."""
        if self.listener is None:
            who = "".join(c for c in str(identity.get("replica") or "vllm") if c.isalnum() or c in "-_")
            self.listener = Listener(f"{self.prefix}{who}.{secrets.token_hex(4)}")
            if not self.listener.open():
                self.listener = None
                return
        self.listener.identity = identity
        self.listener.answer()

    def neighbours(self):
        """What every other supervisor on this node answers."""
        mine = self.listener.name if self.listener is not None else None
        found = []
        for name in abstract_names(self.prefix):
            if name != mine:
                answer = ask(name)
                if answer and "impostor" not in answer:  # what another user's process says is not a neighbour's
                    found.append(answer)
        return found

    def close(self):
        if self.listener is not None:
            self.listener.close()


def abstract_names(prefix):
    """The abstract Unix socket names in this network namespace that start with `prefix` (its NUL included)."""
    shown = "@" + prefix[1:]
    try:
        with open("/proc/net/unix") as handle:
            lines = handle.read().splitlines()[1:]
    except OSError:
        return []
    names = {line.split()[-1] for line in lines if len(line.split()) >= 8 and line.split()[-1].startswith(shown)}
    return sorted("\0" + name[1:] for name in names)


def describe_holder(holder):
    """`coder (node spark-03) since 12:01:02, starting vLLM` from what a holder answered; whatever it answered, a
    line (a holder's answer can neither crash the supervisor nor put anything but text in its status)."""
    if not isinstance(holder, dict) or not holder:
        return "another supervisor on this node"
    impostor = holder.get("impostor")
    if isinstance(impostor, dict):
        return (f"process {impostor.get('pid')} (uid {impostor.get('uid')}), not a supervisor of this stack: it "
                "holds the GPU turn's name, so no vLLM on this node can start until it is ended")  # fmt: skip
    defaults = (("replica", "a single-model stack's vLLM"), ("node", "?"), ("taken", "?"), ("why", "starting"))
    said = {key: str(holder.get(key, default))[:80] for key, default in defaults}
    return f"{said['replica'] or 'a vLLM'} (node {said['node']}) since {said['taken']}, {said['why']}"
