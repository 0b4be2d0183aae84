"""Simulated nodes on one machine for the end-to-end rehearsal.

Each simulated node is a Linux network namespace holding:

* a management link (``mgmt0``) on a per-cluster bridge that the host also sits on
  (``10.77.<k>.1``), so the host reaches every node the way an operator reaches a real node;
* a fabric link (``fab0``) on a second bridge with NO host address: only nodes talk over it,
  like the QSFP cable between two Sparks;
* an ``sshd`` listening on the management address, whose sessions get
  ``DOCKER_HOST=unix://<node socket>`` so ``docker -H ssh://root@<mgmt_ip>`` (what the Pulumi
  docker provider does: ``ssh … docker system dial-stdio``) reaches that node's own daemon;
* a ``dockerd`` started with ``nsenter --net=…`` (not ``ip netns exec``: that remounts /sys and
  hides the cgroup mounts), so ``--network host`` containers see exactly the node's interfaces;

and an image registry (Debian's ``docker-registry``, the distribution registry) on an address of
the host's own (``10.76.<j>.1:5000`` on a link of its own, plain HTTP, which every node's dockerd lists as
an insecure registry), so nodes pull images the way real nodes pull from a registry. Nodes reach it
through the host, their gateway; several clusters can share one (a staging and a prod site pulling
from the same registry), or a cluster brings its own.

Everything a cluster creates carries its id (``<prefix><4 random chars>``, e.g. ``svrx7k2``) in
its name or path, which is how :meth:`SimCluster.close` and :func:`cleanup_stale` find it again.
Usage::

    with simulated_nodes(2, tmp_path) as cluster:
        n1 = cluster.node("node-1")
        cluster.docker_ssh(n1, "info")

Needs root, iproute2, nsenter, dockerd/docker, sshd/ssh/ssh-keygen; iptables is optional.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "svr"
MGMT_PREFIX = "10.77"
FABRIC_PREFIX = "10.78"
NODE_HOST_OFFSET = 10  # node-i gets .<10+i>; .1 is the host on the management bridge
NETNS_DIR = Path("/run/netns")
RUN_ROOT = Path("/run")
SSHD_PRIVSEP_DIR = Path("/run/sshd")
CONTAINERD_SHIM_SOCKETS = "/run/containerd/s/"
SYSTEM_CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
DEFAULT_DOCKER_SOCKET = Path("/run/docker.sock")  # /var/run/docker.sock
REQUIRED_TOOLS = (
    "ip",
    "nsenter",
    "unshare",
    "mount",
    "umount",
    "dockerd",
    "docker",
    "sshd",
    "ssh",
    "ssh-keygen",
    "docker-registry",
)
REGISTRY_PREFIX = "10.76"
REGISTRY_PORT = 5000


class SimNodeError(RuntimeError):
    """A simulated node could not be brought up or torn down."""


class SimNodeWarning(UserWarning):
    """Something of an earlier run's that the sweep before a session could not remove."""


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def _run(argv: Sequence[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing text output; raise with stderr on failure when ``check``."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        detail = proc.stderr.strip() or proc.stdout.strip()
        raise SimNodeError(f"{shlex.join(argv)} failed ({proc.returncode}): {detail}")
    return proc


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not path:
        raise SimNodeError(f"{name} not found")
    return path


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def _wait_for(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _tcp_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.5):
            return True
    except OSError:
        return False


def _have(tool: str) -> bool:
    return shutil.which(tool) is not None or shutil.which(tool, path="/usr/sbin:/sbin") is not None


def missing_prerequisites() -> list[str]:
    """What stops simulated nodes from working here (empty list: good to go)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    missing += [t for t in REQUIRED_TOOLS if not _have(t)]
    if SYSTEM_CONTAINERD_SOCKET.exists():
        # dockerd 20.10 uses a system containerd whenever this socket exists; its shims (and so
        # the --network host containers) would then live in the HOST network namespace.
        missing.append(f"no system containerd ({SYSTEM_CONTAINERD_SOCKET} exists)")
    return missing


def skip_reason() -> str | None:
    """A pytest skip reason, or None when simulated nodes can run."""
    missing = missing_prerequisites()
    return f"simulated nodes need: {', '.join(missing)}" if missing else None


def _proc_start_time(pid: int) -> str | None:
    """Start time of a process (field 22 of /proc/pid/stat): tells a live owner from pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


# --------------------------------------------------------------------------------------------
# data model
# --------------------------------------------------------------------------------------------


@dataclass
class SimNode:
    """One simulated node. Paths on the host; ``netns`` is the namespace name under /run/netns."""

    name: str
    index: int
    netns: str
    mgmt_ip: str
    fabric_ip: str
    state_dir: Path  # <workdir>/<netns>: configs, keys, logs, docker data root
    host_key: str = ""  # "ssh-ed25519 AAAA…" (no comment), filled in at bring-up
    mgmt_interface: str = "mgmt0"
    fabric_interface: str = "fab0"
    ssh_port: int = 22
    _dockerd: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _sshd: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    # paths -----------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.netns

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def docker_socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def docker_host(self) -> str:
        """DOCKER_HOST for reaching this node's daemon directly from the host (tests only)."""
        return f"unix://{self.docker_socket}"

    @property
    def exec_root(self) -> Path:
        return self.run_dir / "exec"

    @property
    def docker_pidfile(self) -> Path:
        return self.run_dir / "docker.pid"

    @property
    def data_root(self) -> Path:
        return self.state_dir / "data"

    @property
    def dockerd_log(self) -> Path:
        return self.state_dir / "dockerd.log"

    @property
    def dockerd_config(self) -> Path:
        return self.state_dir / "daemon.json"

    @property
    def resolv_conf(self) -> Path:
        return self.state_dir / "resolv.conf"

    @property
    def sshd_config(self) -> Path:
        return self.state_dir / "sshd_config"

    @property
    def sshd_pidfile(self) -> Path:
        return self.run_dir / "sshd.pid"

    @property
    def sshd_log(self) -> Path:
        return self.state_dir / "sshd.log"

    @property
    def host_key_path(self) -> Path:
        return self.state_dir / "ssh_host_ed25519_key"

    @property
    def ssh_target(self) -> str:
        return f"root@{self.mgmt_ip}"


@dataclass
class SimCluster:
    """Simulated nodes plus the client-side SSH material to reach them. Use as a context manager."""

    cluster_id: str
    subnet: int  # the <k> in 10.77.<k>.x / 10.78.<k>.x
    workdir: Path
    nodes: list[SimNode] = field(default_factory=list)
    iptables_rules: list[list[str]] = field(default_factory=list)
    registry: SimRegistry | None = None
    _owns_registry: bool = field(default=False, repr=False)
    _closed: bool = field(default=False, repr=False)
    _container_pids: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict, repr=False)

    # naming / paths --------------------------------------------------------------------------
    @property
    def mgmt_bridge(self) -> str:
        return f"{self.cluster_id}-m"

    @property
    def fabric_bridge(self) -> str:
        return f"{self.cluster_id}-f"

    @property
    def host_mgmt_ip(self) -> str:
        return f"{MGMT_PREFIX}.{self.subnet}.1"

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.cluster_id

    @property
    def state_dir(self) -> Path:
        return self.workdir / self.cluster_id

    @property
    def client_key_path(self) -> Path:
        return self.state_dir / "client_ed25519"

    @property
    def client_key_private(self) -> str:
        return self.client_key_path.read_text()

    @property
    def client_key_public(self) -> str:
        return Path(f"{self.client_key_path}.pub").read_text().strip()

    @property
    def authorized_keys_path(self) -> Path:
        return self.state_dir / "authorized_keys"

    @property
    def known_hosts_path(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def ssh_config_path(self) -> Path:
        return self.state_dir / "ssh_config"

    @property
    def bin_dir(self) -> Path:
        """Holds an ``ssh`` wrapper using :attr:`ssh_config_path`; put it first on PATH."""
        return self.state_dir / "bin"

    def ssh_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment in which plain ``ssh``/``docker -H ssh://…`` reach the nodes."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/local/bin:/usr/bin:/bin')}"
        env.pop("DOCKER_HOST", None)
        return env

    # access helpers --------------------------------------------------------------------------
    def node(self, ref: SimNode | str) -> SimNode:
        if isinstance(ref, SimNode):
            return ref
        for n in self.nodes:
            if ref in (n.name, n.netns, n.mgmt_ip):
                return n
        raise KeyError(ref)

    def run_in(
        self, ref: SimNode | str, argv: Sequence[str], check: bool = True, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the node's network namespace (host filesystem and PIDs)."""
        node = self.node(ref)
        return _run(["ip", "netns", "exec", node.netns, *argv], check=check, timeout=timeout, **kw)

    def docker(
        self, ref: SimNode | str, *args: str, check: bool = True, timeout: float = 120, **kw
    ) -> subprocess.CompletedProcess:
        """The docker CLI against the node's daemon socket directly (no SSH)."""
        node = self.node(ref)
        return _run([_tool("docker"), "-H", node.docker_host, *args], check=check, timeout=timeout, **kw)

    def container_root(self, ref: SimNode | str, container: str) -> Path:
        """The root of a running container's filesystem as this host sees it (/proc/<its first process>/root:
        the nodes' containers are this host's processes). A test that polls a file in a container reads it
        there: a `docker exec cat` starts the CLI, and dockerd, containerd and runc work for each read, which
        a wait polling every half second turns into most of a core. The first process is asked of the daemon
        once and kept while it lives (its start time tells it from a reused pid): a restarted container has a
        new one. FileNotFoundError when the container is not running."""
        node = self.node(ref)
        known = self._container_pids.get((node.name, container))
        if known is not None and _proc_start_time(known[0]) == known[1]:
            return Path(f"/proc/{known[0]}/root")
        found = self.docker(node, "inspect", "-f", "{{.State.Pid}}", container, check=False).stdout.strip()
        pid = int(found) if found.isdigit() else 0
        started = _proc_start_time(pid) if pid else None
        if started is None:
            raise FileNotFoundError(f"{container} is not running on {node.name}")
        self._container_pids[(node.name, container)] = (pid, started)
        return Path(f"/proc/{pid}/root")

    def container_file(self, ref: SimNode | str, container: str, path: str) -> str:
        """A file in a running container (see container_root); FileNotFoundError when it or the file is not there."""
        return (self.container_root(ref, container) / path.lstrip("/")).read_text()

    def docker_ssh(
        self, ref: SimNode | str, *args: str, check: bool = True, timeout: float = 120, **kw
    ) -> subprocess.CompletedProcess:
        """The docker CLI over ``ssh://root@<mgmt_ip>``, the path the Pulumi docker provider takes."""
        node = self.node(ref)
        return _run(
            [_tool("docker"), "-H", f"ssh://{node.ssh_target}", *args],
            check=check,
            timeout=timeout,
            env=self.ssh_env(),
            **kw,
        )

    def ssh(
        self, ref: SimNode | str, command: str, check: bool = True, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """Run a shell command on the node over SSH with the generated key and strict host keys."""
        node = self.node(ref)
        return _run(
            ["/usr/bin/ssh", "-F", str(self.ssh_config_path), node.ssh_target, command],
            check=check,
            timeout=timeout,
            **kw,
        )

    # fault injection -------------------------------------------------------------------------
    def start_dockerd(self, ref: SimNode | str, timeout: float = 60) -> None:
        node = self.node(ref)
        _spawn_dockerd(node)
        _wait_dockerd(node, timeout)

    def stop_dockerd(self, ref: SimNode | str, timeout: float = 30, graceful: bool = True) -> None:
        """Stop the node's daemon (SIGTERM, or SIGKILL when not ``graceful``); containers stop with it."""
        node = self.node(ref)
        _stop_process(node._dockerd, node.docker_pidfile, timeout if graceful else 0)
        node._dockerd = None
        # dockerd leaves <exec-root>/netns/default mounted; a restart would stack another mount.
        _umount_under(node.exec_root)

    def start_sshd(self, ref: SimNode | str, timeout: float = 20) -> None:
        node = self.node(ref)
        _spawn_sshd(node)
        _wait_sshd(node, timeout)

    def stop_sshd(self, ref: SimNode | str, timeout: float = 10) -> None:
        """Stop the listening sshd; open sessions survive, as with a real ``systemctl stop ssh``."""
        node = self.node(ref)
        _stop_process(node._sshd, node.sshd_pidfile, timeout)
        node._sshd = None

    @contextlib.contextmanager
    def node_local_view(self, ref: SimNode | str, path: Path, source: Path) -> Iterator[None]:
        """Show ``source`` at ``path`` to this node's SSH sessions only, as a directory that differs
        between real machines (a model missing or different on one node).

        The bind mount lives in the mount namespace of the node's sshd (``ip netns exec`` gave it
        its own, a slave of the host's), so the host and the other nodes keep seeing ``path``. What
        runs over SSH on the host of the node (the preflight, the model fingerprint) sees it; the
        node's dockerd, which runs in a mount namespace of its own, does not. Undone on exit.
        """
        node = self.node(ref)
        if node._sshd is None or _exited(node._sshd):
            raise SimNodeError(f"{node.name}: sshd is not running")
        enter = ["nsenter", f"--target={node._sshd.pid}", "--mount"]
        _run([*enter, "mount", "--bind", str(source), str(path)])
        try:
            yield
        finally:
            _run([*enter, "umount", str(path)], check=False)

    @contextlib.contextmanager
    def node_rdma_view(self, ref: SimNode | str, infiniband: Path) -> Iterator[None]:
        """Show ``infiniband`` as /sys/class/infiniband to this node's SSH sessions (a simulated node has
        no RDMA device; the fabric gate reads this tree). /sys/class cannot gain an entry, so a directory
        of our own is bound over it, holding the node's real /sys/class/net and the fake tree; only in
        the mount namespace of the node's sshd (see node_local_view). Undone on exit."""
        node = self.node(ref)
        if node._sshd is None or _exited(node._sshd):
            raise SimNodeError(f"{node.name}: sshd is not running")
        enter = ["nsenter", f"--target={node._sshd.pid}", "--mount"]
        view = node.state_dir / "sys-class"
        (view / "net").mkdir(parents=True, exist_ok=True)
        (view / "infiniband").mkdir(exist_ok=True)
        _run([*enter, "mount", "--bind", "/sys/class/net", str(view / "net")])
        _run([*enter, "mount", "--bind", str(infiniband), str(view / "infiniband")])
        _run([*enter, "mount", "--rbind", str(view), "/sys/class"])
        try:
            yield
        finally:
            _run([*enter, "umount", "-R", "/sys/class"], check=False)
            for sub in ("infiniband", "net"):
                _run([*enter, "umount", str(view / sub)], check=False)

    # teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Tear everything down; idempotent. Raises SimNodeError listing what could not be removed."""
        if self._closed:
            return
        self._closed = True
        # Graceful part first, so the daemons clean up after themselves; the sweep gets the rest.
        with contextlib.suppress(Exception):
            _stop_processes([(n._sshd, n.sshd_pidfile) for n in self.nodes], 2)
        for node in self.nodes:
            with contextlib.suppress(Exception):
                _kill_containers(node)  # else dockerd stops each container gracefully (slow)
        with contextlib.suppress(Exception):
            _stop_processes([(n._dockerd, n.docker_pidfile) for n in self.nodes], 10)
        for node in self.nodes:
            node._sshd = node._dockerd = None
        errors = _purge(self.cluster_id, extra_dirs=[self.state_dir, *(n.state_dir for n in self.nodes)])
        if self._owns_registry and self.registry is not None:
            try:
                self.registry.close()
            except SimNodeError as error:
                errors.append(str(error))
        if errors:
            raise SimNodeError("teardown left things behind:\n  " + "\n  ".join(errors))

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class SimRegistry:
    """An image registry on an address of the host's own (a link of its own), for one or more clusters."""

    registry_id: str
    subnet: int  # the <j> in 10.76.<j>.1
    workdir: Path
    storage: Path
    _process: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def host(self) -> str:
        return f"{REGISTRY_PREFIX}.{self.subnet}.1"

    @property
    def address(self) -> str:
        """host:port, as image references name the registry."""
        return f"{self.host}:{REGISTRY_PORT}"

    @property
    def link(self) -> str:
        return f"{self.registry_id}-r"

    @property
    def state_dir(self) -> Path:
        return self.workdir / self.registry_id

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.registry_id

    @property
    def config(self) -> Path:
        return self.state_dir / "registry.yml"

    @property
    def log(self) -> Path:
        return self.state_dir / "registry.log"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            _stop_process(self._process, None, 5)
        errors = _purge(self.registry_id, extra_dirs=[self.state_dir])
        if errors:
            raise SimNodeError("registry teardown left things behind:\n  " + "\n  ".join(errors))

    def __enter__(self) -> SimRegistry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_registry(
    workdir: Path, storage: Path | None = None, *, prefix: str = PREFIX, timeout: float = 30, subnet: int | None = None
) -> SimRegistry:
    """A registry at 10.76.<j>.1:5000 keeping its images in ``storage`` (a cache that may outlive it;
    default: its own state directory, removed with it). ``subnet``: the <j> to take when nothing on this host
    uses it (a random free one otherwise), so that what names the registry (an image's tag, a seeded data root:
    tests/e2e/seed.py) is the same run after run."""
    with _picking():  # the whole bring-up: its address is added in it (a registry is made once a session)
        return _create_registry(workdir, storage, prefix=prefix, timeout=timeout, subnet=subnet)


def _create_registry(
    workdir: Path, storage: Path | None, *, prefix: str, timeout: float, subnet: int | None
) -> SimRegistry:
    rid, j = _pick_identity(prefix, subnet)
    workdir = Path(workdir).resolve()
    registry = SimRegistry(registry_id=rid, subnet=j, workdir=workdir, storage=Path(storage or workdir / rid / "data"))
    try:
        _write_owner(registry.run_dir)
        registry.state_dir.mkdir(parents=True, exist_ok=True)
        registry.storage.mkdir(parents=True, exist_ok=True)
        # A veth pair only to hold the address (the dummy driver is not on every kernel).
        _run(["ip", "link", "add", registry.link, "type", "veth", "peer", "name", f"{registry.link}p"])
        _run(["ip", "addr", "add", f"{registry.host}/32", "dev", registry.link])
        for link in (registry.link, f"{registry.link}p"):
            _run(["ip", "link", "set", link, "up"])
        registry.config.write_text(
            "\n".join(
                [
                    "version: 0.1",
                    "log: {level: warn}",
                    f"storage: {{filesystem: {{rootdirectory: {json.dumps(str(registry.storage))}}}}}",
                    f"http: {{addr: {json.dumps(registry.address)}}}",
                    "",
                ]
            )
        )
        log = open(registry.log, "ab")
        # The config path carries the registry id, which is how the sweep finds a leftover one.
        registry._process = subprocess.Popen(
            [_tool("docker-registry"), "serve", str(registry.config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        up = _wait_for(lambda: _tcp_open(registry.host, REGISTRY_PORT) or _exited(registry._process), timeout)
        if not up or _exited(registry._process):
            raise SimNodeError(f"the registry at {registry.address} did not come up:\n{_tail(registry.log)}")
    except BaseException:
        with contextlib.suppress(Exception):
            registry.close()
        raise
    return registry


# --------------------------------------------------------------------------------------------
# bring-up
# --------------------------------------------------------------------------------------------


def _used_names() -> str:
    """Everything that could collide with a new cluster: link names, netns names, addresses."""
    parts = [
        _run(["ip", "-o", "link"], check=False).stdout,
        _run(["ip", "-o", "addr"], check=False).stdout,
        _run(["ip", "route", "show", "table", "all"], check=False).stdout,
    ]
    with contextlib.suppress(OSError):
        parts += os.listdir(NETNS_DIR)
    parts += os.listdir(RUN_ROOT)
    return "\n".join(parts)


@contextlib.contextmanager
def _picking() -> Iterator[None]:
    """One process at a time between choosing a cluster id and subnet and making them visible (the bridge's or
    the registry's address): test processes bring clusters up at the same moment, and two that chose the same
    free subnet had two routes to it (one's SSH reached the other's nodes: "host key mismatch")."""
    with open(RUN_ROOT / "spark-vllm-simnodes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pick_identity(prefix: str, preferred: int | None = None) -> tuple[str, int]:
    """A random cluster id and /24 index not used by anything on this host (`preferred` first, when free)."""
    alphabet = string.ascii_lowercase + string.digits
    used = _used_names()
    for attempt in range(100):
        cid = prefix + "".join(secrets.choice(alphabet) for _ in range(4))
        k = preferred if attempt == 0 and preferred is not None else random.randint(1, 254)
        if any(
            part in used for part in (cid, f"{MGMT_PREFIX}.{k}.", f"{FABRIC_PREFIX}.{k}.", f"{REGISTRY_PREFIX}.{k}.")
        ):
            continue
        return cid, k
    raise SimNodeError("could not find an unused cluster id / subnet")


def _claim(cluster: SimCluster) -> None:
    """Mark the cluster as owned by this live process, so cleanup_stale leaves it alone."""
    _write_owner(cluster.run_dir)


def _write_owner(run_dir: Path) -> None:
    """The run directory and its owner file (pid and start time), under `_picking` as cleanup_stale reads them:
    a sweep in another test process that saw the directory before its owner file took a cluster in the making
    for a killed run's and purged it under its owner (CI, 2026-12-06: every rehearsal test errored)."""
    run_dir.mkdir(parents=True, exist_ok=False)
    pid = os.getpid()
    partial = run_dir / "owner.partial"
    partial.write_text(f"{pid} {_proc_start_time(pid)}\n")
    partial.rename(run_dir / "owner")


def _disable_ipv6(ifname: str) -> None:
    # Keeps the host free of even a link-local address on the fabric side.
    path = Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6")
    if path.exists():
        path.write_text("1")


def _create_bridges(cluster: SimCluster) -> None:
    for br in (cluster.mgmt_bridge, cluster.fabric_bridge):
        _run(["ip", "link", "add", br, "type", "bridge"])
    _disable_ipv6(cluster.fabric_bridge)
    _run(["ip", "addr", "add", f"{cluster.host_mgmt_ip}/24", "dev", cluster.mgmt_bridge])
    for br in (cluster.mgmt_bridge, cluster.fabric_bridge):
        _run(["ip", "link", "set", br, "up"])


def _iptables_backends() -> list[str]:
    """iptables binaries whose FORWARD chain can affect bridged traffic here. Both nft and
    legacy chains are evaluated, so a host dockerd using iptables-legacy with policy DROP
    would drop node traffic despite an ACCEPT in the nft chain. The legacy backend only counts
    when its filter table is already loaded (reading /proc has no side effects, running
    iptables-legacy would load it)."""
    backends = ["iptables"] if _have("iptables") else []
    with contextlib.suppress(OSError):
        if (
            _have("iptables-legacy")
            and "filter" in Path("/proc/net/ip_tables_names").read_text().split()
            and "legacy" not in _run(["iptables", "-V"], check=False).stdout
        ):
            backends.append("iptables-legacy")
    return backends


def _add_iptables_rules(cluster: SimCluster) -> None:
    """Let bridged node-to-node traffic pass FORWARD (a host dockerd sets its policy to DROP),
    and make sure nothing from the nodes is routed beyond the bridges."""
    accept = [["FORWARD", "-i", br, "-o", br, "-j", "ACCEPT"] for br in (cluster.mgmt_bridge, cluster.fabric_bridge)]
    drop = [["FORWARD", "-i", br, "!", "-o", br, "-j", "DROP"] for br in (cluster.mgmt_bridge, cluster.fabric_bridge)]
    for backend in _iptables_backends():
        # the DROPs once are enough (any backend's DROP drops); the ACCEPTs go into every backend
        for rule in accept + (drop if backend == "iptables" else []):
            _run([backend, "-w", "-I", *rule])
            cluster.iptables_rules.append([backend, *rule])


def _create_netns(cluster: SimCluster, node: SimNode, default_route: bool) -> None:
    ns = node.netns
    _run(["ip", "netns", "add", ns])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    cid = cluster.cluster_id
    links = (
        (f"{cid}-m{node.index}", node.mgmt_interface, cluster.mgmt_bridge, node.mgmt_ip),
        (f"{cid}-f{node.index}", node.fabric_interface, cluster.fabric_bridge, node.fabric_ip),
    )
    for host_if, ns_if, bridge, ip in links:
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns])
        if bridge == cluster.fabric_bridge:
            _disable_ipv6(host_if)
        _run(["ip", "link", "set", host_if, "master", bridge, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ns_if])
        _run(["ip", "-n", ns, "link", "set", ns_if, "up"])
    if cluster.registry is not None:
        # The registry is an address of the host's: through the host, as a real node's registry is
        # through its gateway.
        _run(["ip", "-n", ns, "route", "add", f"{cluster.registry.host}/32", "via", cluster.host_mgmt_ip])
    if default_route:
        # Like a real node: the default route leaves through management. This is what makes
        # vLLM/Ray pick the wrong address when VLLM_HOST_IP / --node-ip-address are missing.
        # (Nothing gets out: ip_forward is off or the DROP rules above stop it.)
        _run(["ip", "-n", ns, "route", "add", "default", "via", cluster.host_mgmt_ip])


def _write_client_material(cluster: SimCluster) -> None:
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    _run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            f"{cluster.cluster_id}-client",
            "-f",
            str(cluster.client_key_path),
        ]
    )
    cluster.client_key_path.chmod(0o600)
    cluster.authorized_keys_path.write_text(cluster.client_key_public + "\n")


def _write_node_config(cluster: SimCluster, node: SimNode) -> None:
    node.state_dir.mkdir(parents=True, exist_ok=True)
    node.run_dir.mkdir(parents=True, exist_ok=True)
    node.data_root.mkdir(parents=True, exist_ok=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node.name, "-f", str(node.host_key_path)])
    key_type, key_b64 = Path(f"{node.host_key_path}.pub").read_text().split()[:2]
    node.host_key = f"{key_type} {key_b64}"
    node.sshd_config.write_text(
        "\n".join(
            [
                f"Port {node.ssh_port}",
                f"ListenAddress {node.mgmt_ip}",
                f"HostKey {node.host_key_path}",
                f"PidFile {node.sshd_pidfile}",
                "UsePAM no",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                f"AuthorizedKeysFile {cluster.authorized_keys_path}",
                "StrictModes no",  # the key files live in a pytest tmp dir, not ~/.ssh
                # plain `docker` in a session = this node's daemon. SHLVL=1: the login shell, bash, then counts
                # itself a nested shell and does not source ~/.bashrc for a command sent over SSH, as it does
                # for a top-level one. That file is this machine's root's, not a node's: a developer's may run
                # `pyenv init` (0.12 s of CPU and 0.16 s in every session, with `python3` then a shim: hundreds
                # of sessions in a suite); a clean machine's, as in CI, does nothing.
                f"SetEnv DOCKER_HOST={node.docker_host} SHLVL=1",
                "Subsystem sftp internal-sftp",
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    # An explicit daemon.json keeps /etc/docker/daemon.json from leaking into the nodes.
    insecure = [cluster.registry.address] if cluster.registry else []
    node.dockerd_config.write_text(json.dumps({"insecure-registries": insecure}) + "\n")
    node.resolv_conf.write_text(NODE_RESOLV_CONF)


def _plant_seed(seed: Path, data_root: Path) -> None:
    """A node's Docker data root starts as `seed` (tests/e2e/seed.py), before its dockerd starts: the image's
    layers (overlay2/) as hard links, the rest copied. dockerd never writes into an image layer (overlayfs writes
    a container's changes to the container's own layer; a removed image is unlinked, which leaves the seed's
    link), while the metadata a node changes when it re-tags or removes the image (image/, containerd's and the
    volumes' databases, written in place) must be its own. The copy took 1.9 s of CPU a node (407 MiB)."""
    data_root.mkdir(parents=True, exist_ok=True)
    for part in sorted(seed.iterdir()):
        if part.name == "overlay2" and os.stat(part).st_dev == os.stat(data_root).st_dev:
            _run(["cp", "-al", str(part), str(data_root)], timeout=300)
        else:  # another file system (a tmpfs /tmp) takes no links
            _run(["cp", "-a", "--reflink=auto", str(part), str(data_root)], timeout=300)


def _spawn_sshd(node: SimNode) -> None:
    SSHD_PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    log = open(node.sshd_log, "ab")
    # ip netns exec is fine for sshd (it only breaks dockerd's view of cgroups); it execs, so
    # the Popen pid is sshd's. -D keeps it in the foreground so we own and reap it.
    node._sshd = subprocess.Popen(
        ["ip", "netns", "exec", node.netns, _tool("sshd"), "-D", "-e", "-f", str(node.sshd_config)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()


def _wait_sshd(node: SimNode, timeout: float) -> None:
    if not _wait_for(lambda: _tcp_open(node.mgmt_ip, node.ssh_port) or _exited(node._sshd), timeout) or _exited(
        node._sshd
    ):
        raise SimNodeError(f"sshd of {node.name} ({node.mgmt_ip}) did not come up:\n{_tail(node.sshd_log)}")
    _bind_resolver(node, node._sshd.pid)


# A node asks no name server but its own loopback, where none listens: a lookup fails at once. With this machine's
# /etc/resolv.conf, a reverse lookup from a node (Python's http.server binding an address calls getfqdn) sent its
# query out through the host, to an address no test may reach, and waited 10 s for an answer that never came
# (two tries of 5 s): every start of the stand-in vLLM, 2026-12-07.
NODE_RESOLV_CONF = "# a simulated node (tests/e2e/nodes.py)\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def _bind_resolver(node: SimNode, pid: int) -> None:
    """The node's resolv.conf over /etc/resolv.conf in the mount namespace of `pid` (its sshd's: what its SSH
    sessions run; its dockerd's: what a container on the host network is given)."""
    _run(["nsenter", f"--target={pid}", "--mount", "mount", "--bind", str(node.resolv_conf), "/etc/resolv.conf"])


def _spawn_dockerd(node: SimNode) -> None:
    log = open(node.dockerd_log, "ab")
    # nsenter --net (not `ip netns exec`, which remounts /sys and hides the cgroup mounts); it
    # execs, so the Popen pid is dockerd's. dockerd starts its own containerd, which inherits the
    # namespace, so --network host containers see exactly this node's interfaces. A mount namespace
    # of its own (a slave of the host's: it sees every host mount) lets /var/run/docker.sock be this
    # node's daemon for its containers (see _bind_docker_socket).
    node._dockerd = subprocess.Popen(
        [
            "nsenter",
            f"--net={node.netns_path}",
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            _tool("dockerd"),
            "--config-file",
            str(node.dockerd_config),
            "--data-root",
            str(node.data_root),
            "--exec-root",
            str(node.exec_root),
            "--pidfile",
            str(node.docker_pidfile),
            "-H",
            node.docker_host,
            "--storage-driver",
            "overlay2",  # explicit: never fall back silently to slow vfs
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            "--cgroup-parent",
            f"/{node.netns}",
        ],  # so leftover cgroups carry the cluster id
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()


def _docker_answers(node: SimNode) -> bool:
    if not node.docker_socket.exists():
        return False
    proc = subprocess.run(
        [_tool("docker"), "-H", node.docker_host, "version", "--format", "{{.Server.Version}}"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return proc.returncode == 0


def _wait_dockerd(node: SimNode, timeout: float) -> None:
    ok = _wait_for(lambda: _exited(node._dockerd) or _docker_answers(node), timeout, interval=0.2)
    if not ok or _exited(node._dockerd):
        what = (
            f"exited with {node._dockerd.returncode}"
            if _exited(node._dockerd)
            else f"did not answer on {node.docker_socket} within {timeout}s"
        )
        raise SimNodeError(f"dockerd of {node.name} {what}:\n{_tail(node.dockerd_log)}")
    _bind_docker_socket(node)


def _bind_docker_socket(node: SimNode) -> None:
    """A container that mounts /var/run/docker.sock (the copy depot) reaches its own node's daemon,
    as on a real node: in dockerd's mount namespace, which resolves a container's bind sources,
    the node's socket is bound over the standard path. The host and the other nodes keep theirs."""
    if not DEFAULT_DOCKER_SOCKET.exists():
        DEFAULT_DOCKER_SOCKET.touch()  # a bind needs a target; a host dockerd starting later replaces it
    enter = ["nsenter", f"--target={node._dockerd.pid}", "--mount"]
    _run([*enter, "mount", "--bind", str(node.docker_socket), str(DEFAULT_DOCKER_SOCKET)])
    _bind_resolver(node, node._dockerd.pid)


def _exited(proc: subprocess.Popen | None) -> bool:
    return proc is not None and proc.poll() is not None


def _write_client_config(cluster: SimCluster) -> None:
    cluster.known_hosts_path.write_text("".join(f"{n.mgmt_ip} {n.host_key}\n" for n in cluster.nodes))
    entries = []
    for n in cluster.nodes:
        entries.append(
            "\n".join(
                [
                    f"Host {n.mgmt_ip}",
                    "  User root",
                    f"  Port {n.ssh_port}",
                    f"  IdentityFile {cluster.client_key_path}",
                    "  IdentitiesOnly yes",
                    f"  UserKnownHostsFile {cluster.known_hosts_path}",
                    "  GlobalKnownHostsFile /dev/null",
                    "  StrictHostKeyChecking yes",
                    "  BatchMode yes",
                    "  ConnectTimeout 10",
                    "  LogLevel ERROR",
                ]
            )
        )
    cluster.ssh_config_path.write_text("\n\n".join(entries) + "\n")
    cluster.bin_dir.mkdir(exist_ok=True)
    wrapper = cluster.bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {shlex.quote(str(cluster.ssh_config_path))} "$@"\n')
    wrapper.chmod(0o755)


def create_cluster(
    count: int,
    workdir: Path,
    *,
    prefix: str = PREFIX,
    default_route: bool = True,
    timeout: float = 90,
    registry: SimRegistry | None = None,
    registry_storage: Path | None = None,
    fabric_interfaces: tuple[str, ...] = (),
    seed: Path | None = None,
) -> SimCluster:
    """Bring up ``count`` nodes; on any failure tear down what was built and re-raise.

    ``default_route``: give each node a default route via the host's management address, like
    a real node (nothing is forwarded beyond the bridge). ``registry``: the registry the nodes
    pull from (shared with other clusters); without one the cluster brings its own, which keeps
    its images in ``registry_storage`` (default: the cluster's state directory).
    ``fabric_interfaces``: the fabric interface's name on each node, in order (default fab0 on all).
    ``seed``: a Docker data root each node's daemon starts from (tests/e2e/seed.py: the image already pulled).
    """
    if count < 1 or count > 200:
        raise ValueError("count must be between 1 and 200")
    missing = missing_prerequisites()
    if missing:
        raise SimNodeError(f"simulated nodes need: {', '.join(missing)}")
    with _picking():
        cluster = _new_cluster(prefix, count, workdir, registry, fabric_interfaces)
    try:
        if cluster.registry is None:
            cluster.registry = create_registry(cluster.workdir, registry_storage, prefix=prefix)
            cluster._owns_registry = True
        _write_client_material(cluster)
        _add_iptables_rules(cluster)
        for node in cluster.nodes:
            _create_netns(cluster, node, default_route)
            _write_node_config(cluster, node)
            if seed is not None:
                _plant_seed(seed, node.data_root)
        # Start every daemon first and wait afterwards: the nodes come up in parallel.
        for node in cluster.nodes:
            _spawn_sshd(node)
            _spawn_dockerd(node)
        for node in cluster.nodes:
            _wait_sshd(node, timeout)
            _wait_dockerd(node, timeout)
        _write_client_config(cluster)
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.close()
        raise
    return cluster


def _new_cluster(
    prefix: str, count: int, workdir: Path, registry: SimRegistry | None, fabric_interfaces: tuple[str, ...]
) -> SimCluster:
    """A cluster with a free id and subnet, claimed, its bridges up with their addresses (under `_picking`)."""
    cid, k = _pick_identity(prefix)
    cluster = SimCluster(cluster_id=cid, subnet=k, workdir=Path(workdir).resolve(), registry=registry)
    cluster.nodes = [
        SimNode(
            name=f"node-{i}",
            index=i,
            netns=f"{cid}-n{i}",
            mgmt_ip=f"{MGMT_PREFIX}.{k}.{NODE_HOST_OFFSET + i}",
            fabric_ip=f"{FABRIC_PREFIX}.{k}.{NODE_HOST_OFFSET + i}",
            state_dir=cluster.workdir / f"{cid}-n{i}",
            fabric_interface=fabric_interfaces[i - 1] if len(fabric_interfaces) >= i else "fab0",
        )
        for i in range(1, count + 1)
    ]
    try:
        _claim(cluster)
        _create_bridges(cluster)
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.close()
        raise
    return cluster


@contextlib.contextmanager
def simulated_nodes(count: int, workdir: Path, **kw) -> Iterator[SimCluster]:
    """``with simulated_nodes(2, tmp) as cluster:`` — always torn down, also on exceptions."""
    cluster = create_cluster(count, workdir, **kw)
    try:
        yield cluster
    finally:
        cluster.close()


def sim_cluster_fixture(count: int = 2, *, scope: str = "session", name: str | None = None, prefix: str = PREFIX, **kw):
    """A pytest fixture factory for conftest.py: ``sim_cluster = sim_cluster_fixture(2)``.

    Skips when prerequisites are missing; removes leftovers of killed earlier runs first.
    """
    import pytest

    @pytest.fixture(scope=scope, name=name)
    def _sim_cluster(tmp_path_factory) -> Iterator[SimCluster]:
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        cleanup_stale(prefix, strict=False)
        with simulated_nodes(count, tmp_path_factory.mktemp("simnodes"), prefix=prefix, **kw) as cluster:
            yield cluster

    return _sim_cluster


# --------------------------------------------------------------------------------------------
# teardown / sweeping
# --------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """True unless gone or a zombie (zombies hold no namespaces or mounts)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _resolve_pid(proc: subprocess.Popen | None, pidfile: Path | None) -> int | None:
    """The live pid to stop: our Popen, or the pidfile if we lost the Popen (None: nothing to do)."""
    pid = proc.pid if proc is not None else None
    if pid is None and pidfile is not None:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().split()[0])
    if proc is not None and proc.poll() is not None:  # already exited: reap, nothing to signal
        return None
    return pid if pid is not None and _pid_alive(pid) else None


def _stop_processes(targets: Sequence[tuple[subprocess.Popen | None, Path | None]], timeout: float) -> None:
    """SIGTERM all targets at once, wait up to ``timeout`` for all, then SIGKILL the rest.
    Signalling together makes N dockerd shutdowns cost one, not N."""
    live = [(proc, pid) for proc, pidfile in targets if (pid := _resolve_pid(proc, pidfile)) is not None]
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        live = [(proc, pid) for proc, pid in live if not _gone(proc, pid)]
        for _, pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        # Popen.poll() reaps our own children, so they do not linger as zombies
        _wait_for(lambda live=live: all(_gone(proc, pid) for proc, pid in live), wait, interval=0.05)


def _gone(proc: subprocess.Popen | None, pid: int) -> bool:
    return proc.poll() is not None if proc is not None else not _pid_alive(pid)


def _stop_process(proc: subprocess.Popen | None, pidfile: Path | None, timeout: float) -> None:
    _stop_processes([(proc, pidfile)], timeout)


def _kill_containers(node: SimNode) -> None:
    """SIGKILL every container so dockerd's shutdown is quick (it would stop them gracefully)."""
    if not node.docker_socket.exists():
        return
    docker = [_tool("docker"), "-H", node.docker_host]
    ids = _run([*docker, "ps", "-q"], check=False, timeout=15).stdout.split()
    if ids:
        _run([*docker, "kill", *ids], check=False, timeout=30)


def _unescape_mount(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, root) for every mount in our mount namespace."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        out.append((_unescape_mount(fields[4]), _unescape_mount(fields[3])))
    return out


def _umount_matching(match: Callable[[str], bool]) -> list[str]:
    """Lazily unmount matching mount points, deepest first, until none is left."""
    for _ in range(10):
        targets = sorted({mp for mp, _ in _mounts() if match(mp)}, key=len, reverse=True)
        if not targets:
            return []
        for mp in targets:
            subprocess.run(["umount", "-l", mp], capture_output=True)
    return [mp for mp, _ in _mounts() if match(mp)]


def _umount_under(directory: Path) -> list[str]:
    prefix = str(directory).rstrip("/") + "/"
    return _umount_matching(lambda mp: mp.startswith(prefix) or mp == str(directory))


def _netns_ids(cid: str) -> set[tuple[int, int]]:
    """(dev, inode) of the cluster's network namespaces, to recognise processes inside them."""
    ids = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(NETNS_DIR):
            if name.startswith(cid):
                with contextlib.suppress(OSError):
                    st = os.stat(NETNS_DIR / name)
                    ids.add((st.st_dev, st.st_ino))
    return ids


def _cluster_pids(cid: str, netns_ids: set[tuple[int, int]]) -> list[int]:
    """Live processes belonging to the cluster: inside one of its namespaces, or whose command
    line, cwd or root refers to one of its paths (containers with their own netns, shims, CLIs)."""
    me = {os.getpid(), os.getppid()}
    marker = re.compile(rf"(/|=|^){re.escape(cid)}")
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in me:
            continue
        pid = int(entry)
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
            if (st.st_dev, st.st_ino) in netns_ids:
                pids.append(pid)
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            refs = cmdline + [os.readlink(f"/proc/{pid}/cwd"), os.readlink(f"/proc/{pid}/root")]
        except OSError:
            continue
        if any(marker.search(r) for r in refs):
            pids.append(pid)
    return [p for p in pids if _pid_alive(p)]


def _shim_sockets(pids: list[int]) -> set[str]:
    """containerd-shim sockets (/run/containerd/s/<hash>) bound in the processes' namespaces:
    their names carry no cluster id and a SIGKILLed shim leaves them behind."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith(CONTAINERD_SHIM_SOCKETS):
                    found.add(parts[7])
    return found


def _kill_cluster_processes(cid: str) -> list[str]:
    netns_ids = _netns_ids(cid)
    sockets: set[str] = set()
    for _ in range(20):  # repeat: a dying parent may still spawn or reparent children
        pids = _cluster_pids(cid, netns_ids)
        if not pids:
            break
        sockets |= _shim_sockets(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_for(lambda pids=pids: not any(_pid_alive(p) for p in pids), 5)
    for sock in sockets:
        with contextlib.suppress(OSError):
            os.unlink(sock)
    return [f"process {p} ({_process_state(p)}): {_cmdline(p)[:120]!r}" for p in _cluster_pids(cid, netns_ids)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _process_state(pid: int) -> str:
    """What a process that outlived SIGKILL is doing: its state (D: in the kernel), parent and kernel wait."""
    facts = []
    with contextlib.suppress(OSError):
        status = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
        )
        facts += [f"state {status.get('State', '?').strip()}", f"parent {status.get('PPid', '?').strip()}"]
    with contextlib.suppress(OSError):
        facts.append(f"waiting in {Path(f'/proc/{pid}/wchan').read_text().strip() or '-'}")
    return ", ".join(facts) or "gone"


def _delete_netns(cid: str) -> list[str]:
    errors = []
    with contextlib.suppress(OSError):
        for name in os.listdir(NETNS_DIR):
            if name.startswith(cid):
                proc = _run(["ip", "netns", "del", name], check=False)
                path = NETNS_DIR / name
                if path.exists():
                    subprocess.run(["umount", "-l", str(path)], capture_output=True)
                    with contextlib.suppress(OSError):
                        path.unlink()
                if path.exists():
                    errors.append(f"netns {name}: {proc.stderr.strip()}")
    return errors


def _links(cid: str) -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(cid)]


def _delete_links(cid: str) -> list[str]:
    # veths first (deleting one end removes its peer, even if the namespace is still pinned), then bridges
    for name in sorted(_links(cid), key=lambda n: n.endswith(("-m", "-f"))):
        _run(["ip", "link", "del", name], check=False)
    return [f"link {n}" for n in _links(cid)]


def _iptables_rules(cid: str) -> list[tuple[str, str]]:
    """(backend, "-A FORWARD …" line) of every rule mentioning the cluster."""
    found = []
    for backend in _iptables_backends():
        out = _run([backend, "-w", "-S", "FORWARD"], check=False).stdout
        found += [(backend, line) for line in out.splitlines() if line.startswith("-A ") and cid in line]
    return found


def _delete_iptables_rules(cid: str) -> list[str]:
    for backend, line in _iptables_rules(cid):
        _run([backend, "-w", "-D", *shlex.split(line)[1:]], check=False)
    return [f"{backend} {rule}" for backend, rule in _iptables_rules(cid)]


def _cgroup_dirs(cid: str) -> list[Path]:
    found = []
    root = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        for hierarchy in [root, *root.iterdir()]:
            with contextlib.suppress(OSError):
                found += [p for p in hierarchy.iterdir() if p.is_dir() and p.name.startswith(cid)]
    return found


def _delete_cgroups(cid: str) -> list[str]:
    for top in _cgroup_dirs(cid):
        # rmdir bottom-up; cgroup dirs only ever "contain" child cgroups
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
    return [f"cgroup {p}" for p in _cgroup_dirs(cid)]


def _remove_dirs(dirs: list[Path]) -> list[str]:
    errors = []
    for d in dirs:
        if not d.exists():
            continue
        busy = [mp for mp, _ in _mounts() if mp.startswith(str(d).rstrip("/") + "/")]
        if busy:  # never rmtree through a live mount: it could reach outside the cluster
            errors.append(f"dir {d}: still mounted {busy[:3]}")
            continue
        shutil.rmtree(d, ignore_errors=True)
        if d.exists():
            errors.append(f"dir {d}")
    return errors


def _purge(cid: str, extra_dirs: Sequence[Path] = ()) -> list[str]:
    """Remove every trace of cluster ``cid``: processes, mounts, namespaces, links, iptables
    rules, cgroups, directories. Returns what could not be removed."""
    errors = _kill_cluster_processes(cid)
    # dockerd leaves <exec-root>/netns/default (pinning the namespace) and overlay/shm mounts
    # under the data root; all carry the cluster id in their path. /run/netns/* go via `ip netns del`.
    marker = re.compile(rf"/{re.escape(cid)}")
    errors += [
        f"mount {m}"
        for m in _umount_matching(lambda mp: bool(marker.search(mp)) and not mp.startswith(f"{NETNS_DIR}/"))
    ]
    errors += _delete_netns(cid)
    errors += _delete_links(cid)
    errors += _delete_iptables_rules(cid)
    errors += _delete_cgroups(cid)
    run_dirs = [RUN_ROOT / n for n in os.listdir(RUN_ROOT) if n.startswith(cid)]
    errors += _remove_dirs([*extra_dirs, *run_dirs])
    return errors


def _owner_alive(cid: str) -> bool:
    try:
        pid_s, start = (RUN_ROOT / cid / "owner").read_text().split()
    except (OSError, ValueError):
        return False
    return _pid_alive(int(pid_s)) and _proc_start_time(int(pid_s)) == start


def find_cluster_ids(prefix: str = PREFIX) -> set[str]:
    """Ids of clusters with anything left on this host (namespaces, links, dirs, mounts, rules,
    cgroups, processes)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(prefix)}[a-z0-9]{{4}}(?=-|/|\s|$)")
    names: list[str] = [_used_names()]
    names += [mp for mp, _ in _mounts()]
    names += [_run([b, "-w", "-S", "FORWARD"], check=False).stdout for b in _iptables_backends()]
    names += [p.name for p in _cgroup_dirs(prefix)]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                names.append(Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").replace("\0", " "))
    return {m.group(0) for text in names for m in pattern.finditer(text)}


def cleanup_stale(
    prefix: str = PREFIX, workdir: Path | None = None, force: bool = False, strict: bool = True
) -> list[str]:
    """Remove leftovers of clusters whose owning process is gone (a killed earlier run).

    Clusters owned by a live process are kept unless ``force``. ``workdir`` (optional) is
    where their state dirs lived; the dirs are removed from it too. Returns the ids removed.
    Raises SimNodeError if something could not be removed; with ``strict=False`` (the sweep before a test
    session) it warns instead: a new cluster takes an id and subnet nothing on the host uses, so a leftover
    that will not go (a process the kernel does not end) is in no one's way, and failing every test of the
    session for it tests nothing.
    """
    removed, errors = [], []
    with _picking():  # no cluster is between its first trace and its owner file while this looks
        for cid in sorted(find_cluster_ids(prefix)):
            if not force and _owner_alive(cid):
                continue
            dirs = [Path(workdir) / n for n in os.listdir(workdir) if n.startswith(cid)] if workdir else []
            errors += _purge(cid, dirs)
            removed.append(cid)
    if errors:
        message = "cleanup_stale left things behind:\n  " + "\n  ".join(errors)
        if strict:
            raise SimNodeError(message)
        warnings.warn(message, SimNodeWarning, stacklevel=2)
    return removed


def leftovers(cluster_id: str) -> list[str]:
    """Anything of the cluster still present on the host (empty after a clean teardown)."""
    marker = re.compile(rf"/{re.escape(cluster_id)}")
    found = [f"process {p}" for p in _cluster_pids(cluster_id, _netns_ids(cluster_id))]
    found += [f"mount {mp}" for mp, _ in _mounts() if marker.search(mp)]
    with contextlib.suppress(OSError):
        found += [f"netns {n}" for n in os.listdir(NETNS_DIR) if n.startswith(cluster_id)]
    found += [f"link {n}" for n in _links(cluster_id)]
    found += [f"{backend} {rule}" for backend, rule in _iptables_rules(cluster_id)]
    found += [f"cgroup {p}" for p in _cgroup_dirs(cluster_id)]
    found += [f"dir /run/{n}" for n in os.listdir(RUN_ROOT) if n.startswith(cluster_id)]
    return found
