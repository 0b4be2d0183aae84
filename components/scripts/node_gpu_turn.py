# The node's GPU turn (the supervisor's): vLLM sizes its KV
# cache by profiling, counting every change of the GPU's used memory while it starts as its own, so two vLLMs
# starting at once on one GPU each count the other's (vLLM issue 55827): one refuses ("No available memory for
# the cache blocks"), the other takes more than its gpuMemoryUtilization. So a supervisor starts vLLM only while
# it holds the node's turn, and holds it until vLLM serves or exits.
#
# The turn lives in a directory only the stack's supervisors reach: the node's `spark-vllm-gpu-turn` volume, which
# every node container of the stack mounts (names.GPU_TURN_DIR_IN_NODE; Docker makes it root's, 0755, under
# /var/lib/docker, which no other user of the node can enter). The turn is an flock on `turn.lock` in it: the
# kernel frees it the moment its holder dies (a SIGKILL, a container stopped, a reboot). The holder listens on
# `turn.sock` beside it and answers who it is, so a waiting supervisor can say who holds the turn. Each supervisor
# also answers, on a socket of its own (`tenant.<replica>.<random>.sock`), what its vLLM asks of the GPU and how it
# is doing, so a supervisor can name its neighbours when the GPU's memory is theirs. (Until #58 these were abstract
# Unix sockets, which have no permissions: any process of the host's network namespace could take the turn's name
# first and keep every vLLM of the node from starting, or pose as a neighbour.) A directory that another user
# could write in is refused; a listener of another user is not believed (SO_PEERCRED). SPARK_VLLM_GPU_TURN names
# another directory (tests running several "nodes" on one host). Standard library only, no side effects.
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import struct
import time

TENANT_PREFIX = "tenant."
STALE_SOCKET_SECONDS = 60  # a neighbour's socket nobody answers on, this old: its supervisor died without a word


class TurnDirectoryError(RuntimeError):
    pass


def turn_directory(path):
    """`path`, made if missing (0700); refused when it is not a directory of this user that only it may write in
    (a place others can write in would let them take the turn or pose as a neighbour)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as error:
        raise TurnDirectoryError(f"the GPU turn's directory {path}: {error}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise TurnDirectoryError(
            f"the GPU turn's directory {path} is not a directory that only uid {os.geteuid()} may write in (owner "
            f"uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): another user could take the node's GPU turn"
        )
    return path


class GpuTurn:
    def __init__(self, directory):
        self.directory = turn_directory(directory)
        self.listener = Listener(os.path.join(directory, "turn.sock"))
        self.lock = None  # the file descriptor holding the flock while this supervisor holds the turn
        self.since = None  # monotonic time it was taken

    @property
    def held(self):
        return self.lock is not None

    def take(self, identity):
        """Whether this supervisor holds the turn now (taken, or already held); `identity` is what it answers."""
        if self.held:
            return True
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        lock = os.open(os.path.join(self.directory, "turn.lock"), flags, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(lock)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self.lock, self.since = lock, time.monotonic()
        self.listener.identity = {**identity, "taken": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        remove_socket(self.listener.name)  # the last holder's, if it died holding the turn
        self.listener.open()
        return True

    def answer(self):
        """Tells each supervisor that asked who holds the turn (called from the holder's loop)."""
        self.listener.answer()

    def holder(self):
        """Who holds the turn ({} when it cannot tell, None when nobody answers)."""
        return ask(self.listener.name)

    def give_back(self):
        if self.lock is None:
            return
        self.listener.close()  # its socket goes before the lock: the next holder never finds this one's
        os.close(self.lock)
        self.lock, self.since = None, None


class Listener:
    """A listening Unix socket at a path that answers each connection with one JSON line (`identity`)."""

    def __init__(self, name):
        self.name = name
        self.identity = {}
        self.socket = None

    def open(self):
        """Whether it listens now (False: the name is taken, or cannot be bound: a path too long, a directory
        gone; the turn is held all the same, only nobody can ask who holds it)."""
        if self.socket is not None:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
        except OSError:
            sock.close()
            return False
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
            remove_socket(self.name)
        self.socket = None


def remove_socket(path):
    """Removes the socket at `path` if one is there (never anything else)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def ask(name, timeout=1.5):
    """What the socket `name` answers: a mapping (None: nobody listens there; {}: no answer, or one that is not a
    mapping). A listener of another user than this supervisor's (the stack's own run as root) is not believed: its
    answer is {"impostor": {"pid", "uid"}}, what the kernel says of it (SO_PEERCRED), never what it says of itself."""
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

    def __init__(self, directory):
        self.directory = turn_directory(directory)
        self.listener = None

    def tell(self, identity):
        """What this supervisor answers now (its replica, its share of the GPU, its state)."""
        if self.listener is None:
            who = "".join(c for c in str(identity.get("replica") or "vllm")[:32] if c.isalnum() or c in "-_")
            name = f"{TENANT_PREFIX}{who}.{secrets.token_hex(4)}.sock"
            self.listener = Listener(os.path.join(self.directory, name))
            if not self.listener.open():
                self.listener = None
                return
        self.listener.identity = identity
        self.listener.answer()

    def neighbours(self):
        """What every other supervisor on this node answers; a socket nobody answers on for a while is tidied."""
        mine = self.listener.name if self.listener is not None else None
        found = []
        for path in tenant_sockets(self.directory):
            if path == mine:
                continue
            answer = ask(path)
            if answer is None:
                forget_if_stale(path)
            elif "impostor" not in answer and answer:  # what another user's process says is not a neighbour's
                found.append(answer)
        return found

    def close(self):
        if self.listener is not None:
            self.listener.close()


def tenant_sockets(directory):
    """The paths of the neighbours' sockets in the turn's directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [os.path.join(directory, n) for n in sorted(names) if n.startswith(TENANT_PREFIX) and n.endswith(".sock")]


def forget_if_stale(path):
    """A neighbour's socket nobody listens on: its supervisor died without closing it (a SIGKILL). Removed once it
    is old enough that it cannot be one being opened this moment."""
    try:
        if time.time() - os.lstat(path).st_mtime > STALE_SOCKET_SECONDS:
            remove_socket(path)
    except OSError:
        pass


def hold_limit(holder):
    """How long the holder said it may hold the turn (seconds; None where it said nothing usable)."""
    said = holder.get("hold_seconds") if isinstance(holder, dict) else None
    if isinstance(said, (int, float)) and not isinstance(said, bool) and 0 < said <= 7 * 24 * 3600:
        return float(said)
    return None


def turn_wait_bound(limit):
    """How long a supervisor waits for the turn before starting without it: the holder's limit (a supervisor gives
    the turn back at it, checking every second) and a grace as long (at most a minute) for a loaded node's loop.
    A holder past that is stopped or hung, and no vLLM of the node should wait on it for ever."""
    return limit + min(60.0, limit)


def describe_holder(holder):
    """`coder (node spark-03) since 12:01:02, starting vLLM` from what a holder answered; whatever it answered, a
    line (a holder's answer can neither crash the supervisor nor put anything but text in its status)."""
    if not isinstance(holder, dict) or not holder:
        return "another supervisor on this node"
    impostor = holder.get("impostor")
    if isinstance(impostor, dict):
        return (f"process {impostor.get('pid')} (uid {impostor.get('uid')}), not a supervisor of this stack: it "
                "answers on the GPU turn's socket: it is not believed")  # fmt: skip
    defaults = (("replica", "a single-model stack's vLLM"), ("node", "?"), ("taken", "?"), ("why", "starting"))
    said = {key: str(holder.get(key, default))[:80] for key, default in defaults}
    return f"{said['replica'] or 'a vLLM'} (node {said['node']}) since {said['taken']}, {said['why']}"
