# The fabric gate's probe: runs on a node's HOST as `python3 -` (its parameters in the
# program: node_params.py), on every node at once, before any container of the stack.
# It only reads and measures, then prints one JSON line of facts; components/fabric.py judges them
# (per node and across the nodes) and the deploy stops there when they show a problem.
#
#   interface  the fabric interface in /sys/class/net: operstate, carrier, MTU, speed (Mb/s), its IPv4
#              addresses (`ip -o -4 addr show`)
#   rdma       every RDMA device under /sys/class/infiniband: per port its state, link layer, the network
#              device it sits on, and the GID table's index of a "RoCE v2" entry for the fabric address
#   peers      per other node: the route (`ip route get`), a ping through the fabric interface, and a
#              full-size one with "don't fragment" (`ping -M do -s MTU-28`)
#   bandwidth  a short TCP test: a listener on the fabric address (P.bandwidth.port) for the
#              nodes that measure towards this one, and `streams` connections to each target sending
#              for `seconds`; the receiving side counts what arrived and says so
# stdlib only: the hosts have python3 (the model fingerprint needs it too), ip (iproute2), ping (iputils).
import json
import os
import socket
import subprocess
import threading
import time

from components.scripts.node_contract import FabricFacts, FabricGateParams, LinkFacts, PeerPath, RdmaPort, StreamResult
from components.scripts.node_params import given
from components.scripts.node_timing import polls

P = FabricGateParams.from_json(given())
NET = "/sys/class/net"
CHUNK = b"\0" * (1 << 20)


def read(path):
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def number(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def interface_facts(name):
    base = os.path.join(NET, name)
    if not os.path.isdir(base):
        return LinkFacts(exists=False, present=sorted(os.listdir(NET)) if os.path.isdir(NET) else [])
    try:
        flags = int(read(os.path.join(base, "flags")) or "", 16)
    except ValueError:
        flags = None
    speed = number(read(os.path.join(base, "speed")))  # -1 or unreadable when unknown (link down)
    addresses = []
    try:
        shown = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", name], capture_output=True, text=True)
        addresses = [line.split()[3].split("/")[0] for line in shown.stdout.splitlines() if len(line.split()) > 3]
    except OSError:
        pass
    return LinkFacts(
        exists=True,
        operstate=read(os.path.join(base, "operstate")),
        up=bool(flags & 1) if flags is not None else None,  # IFF_UP
        carrier=number(read(os.path.join(base, "carrier"))),  # unreadable while the interface is down
        mtu=number(read(os.path.join(base, "mtu"))),
        speed_mbps=speed if speed is not None and speed > 0 else None,
        addresses=addresses,
    )


def address_elsewhere(address):
    try:
        shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    except OSError:
        return []
    return [line.split()[1] for line in shown.stdout.splitlines()
            if len(line.split()) > 3 and line.split()[3].split("/")[0] == address]  # fmt: skip


def mapped(address):
    """The GID the kernel lists for an IPv4 address on RoCE: its IPv4-mapped IPv6 address, written out."""
    octets = [int(o) for o in address.split(".")]
    return f"0000:0000:0000:0000:0000:ffff:{octets[0]:02x}{octets[1]:02x}:{octets[2]:02x}{octets[3]:02x}"


def rdma_facts(root, address):
    if not os.path.isdir(root):
        return []
    found = []
    for device in sorted(os.listdir(root)):
        ports = os.path.join(root, device, "ports")
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
            base = os.path.join(ports, port)
            state = read(os.path.join(base, "state")) or ""  # "4: ACTIVE"
            netdev, rocev2 = None, None
            gids = os.path.join(base, "gids")
            for index in sorted(os.listdir(gids), key=lambda i: int(i)) if os.path.isdir(gids) else []:
                ndev = read(os.path.join(base, "gid_attrs", "ndevs", index))
                netdev = netdev or ndev
                kind = read(os.path.join(base, "gid_attrs", "types", index)) or ""
                if kind.lower() == "roce v2" and (read(os.path.join(gids, index)) or "").lower() == mapped(address):
                    rocev2 = int(index) if rocev2 is None else rocev2
            if netdev is None:  # no GID yet (no address): the PCI function's network device
                nets = os.path.join(root, device, "device", "net")
                netdev = next(iter(sorted(os.listdir(nets))), None) if os.path.isdir(nets) else None
            found.append(RdmaPort(
                device=device,
                port=int(port),
                state=state.split(":")[-1].strip(),
                link_layer=read(os.path.join(base, "link_layer")),
                netdev=netdev,
                rocev2_gid_index=rocev2,
            ))  # fmt: skip
    return found


def run(argv, timeout):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return done.returncode, (done.stdout + done.stderr).strip()
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    except OSError as error:
        return 127, str(error)


def peer_facts(peer, interface, mtu, have_ping):
    code, route = run(["ip", "route", "get", peer.address], 5)
    words = route.split()
    seen = {"route_dev": words[words.index("dev") + 1] if code == 0 and "dev" in words else None}
    if code != 0:
        seen["route_error"] = route.splitlines()[0] if route else f"exit {code}"
    if have_ping:
        code, out = run(["ping", "-c", "1", "-W", "2", "-I", interface, peer.address], 10)
        seen["reach"] = code == 0
        if code == 0 and mtu:
            size = min(mtu - 28, 65507)  # IPv4 header and ICMP header; 65507 is the most an IPv4 packet carries
            code, out = run(["ping", "-c", "1", "-W", "2", "-M", "do", "-s", str(size), "-I", interface,
                             peer.address], 10)  # fmt: skip
            seen["full_size"] = code == 0
            if code != 0:
                seen["full_size_said"] = out.splitlines()[-1][:200] if out else f"exit {code}"
    return PeerPath(address=peer.address, **seen)


# --- the bandwidth test -------------------------------------------------------------------------
class Listener:
    """Counts what each connecting node sends; answers each stream with its bytes and seconds."""

    def __init__(self, address, port, expect):
        self.expect, self.done, self.finished, self.lock = set(expect), {}, {}, threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.sock.settimeout(0.5)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        with conn:
            conn.settimeout(30)
            header = b""
            while not header.endswith(b"\n") and len(header) < 512:
                piece = conn.recv(1)
                if not piece:
                    return
                header += piece
            try:
                hello = json.loads(header)
            except ValueError:
                return
            received, first, last = 0, None, None
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                last = time.monotonic()
                first = first or last
                received += len(data)
            seconds = (last - first) if first is not None else 0.0
            conn.sendall(json.dumps({"bytes": received, "seconds": seconds}).encode() + b"\n")
            with self.lock:  # a peer is done once all its streams are (they end in any order)
                sender = hello.get("from")
                self.finished[sender] = self.finished.get(sender, 0) + 1
                if self.finished[sender] >= hello.get("streams", 1):
                    self.done[sender] = True

    def wait(self, deadline):
        for _ in polls(deadline - time.monotonic(), 0.1):
            with self.lock:
                if self.expect <= set(self.done):
                    break
        with self.lock:
            return sorted(self.done), sorted(self.expect - set(self.done))


def connect(address, port, source, deadline):
    """A connection from the fabric address to a peer's listener, retried until the deadline (the
    peer's gate may start a moment later)."""
    error = None
    for _ in polls(deadline - time.monotonic(), 0.2):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((source, 0))
            sock.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
            sock.connect((address, port))
            return sock, None
        except OSError as caught:
            error = caught
            sock.close()
    return None, f"no listener at {address}:{port} within the wait ({error})"


def measure(peer, bandwidth, source, deadline, me):
    streams, seconds = bandwidth.streams, bandwidth.seconds
    socks = []
    for _ in range(streams):
        sock, error = connect(peer.address, bandwidth.port, source, deadline)
        if sock is None:
            for other in socks:
                other.close()
            return StreamResult(error=error)
        socks.append(sock)
    results, errors = [None] * streams, []

    def send(index, sock):
        try:
            sock.settimeout(30)
            sock.sendall(json.dumps({"from": me, "stream": index, "streams": streams}).encode() + b"\n")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                sock.sendall(CHUNK)
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while not answer.endswith(b"\n"):
                piece = sock.recv(4096)
                if not piece:
                    break
                answer += piece
            results[index] = json.loads(answer)
        except (OSError, ValueError) as error:
            errors.append(str(error))
        finally:
            sock.close()

    threads = [threading.Thread(target=send, args=(i, s)) for i, s in enumerate(socks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors or None in results:
        return StreamResult(error="; ".join(errors) or "a stream got no answer")
    total = sum(r["bytes"] for r in results)  # the listener's answers (Listener.serve)
    window = max(r["seconds"] for r in results) or seconds
    return StreamResult(gbps=round(total * 8 / window / 1e9, 3), bytes=total, seconds=round(window, 3), streams=streams)


def main():
    started = time.monotonic()
    interface, address, bandwidth = P.interface, P.address, P.bandwidth
    link = interface_facts(interface)
    found = {"node": P.node, "interface": link, "address_on": address_elsewhere(address)}
    found["rdma"] = rdma_facts(P.rdma_root, address)
    listener = None
    if bandwidth and bandwidth.expect:
        try:
            listener = Listener(address, bandwidth.port, bandwidth.expect)
        except OSError as error:
            found["listen_error"] = f"cannot listen on {address}:{bandwidth.port}: {error}"
    # A peer that does not answer a ping over the fabric is neither measured nor waited for: the
    # finding is the ping's, and the gate does not sit out its whole wait.
    have_ping = bool(run(["sh", "-c", "command -v ping"], 5)[1])
    peers = {}

    def probe(peer):
        peers[peer.name] = peer_facts(peer, interface, link.mtu, have_ping)

    threads = [threading.Thread(target=probe, args=(peer,)) for peer in P.peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if bandwidth:
        unreachable = {name for name, seen in peers.items() if seen.reach is False or not seen.route_dev}
        deadline = time.monotonic() + bandwidth.wait_seconds
        found["bandwidth"] = {
            peer.name: StreamResult(skipped="no answer over the fabric")
            if peer.name in unreachable
            else measure(peer, bandwidth, address, deadline, P.node)
            for peer in P.peers
            if peer.name in bandwidth.targets
        }
        if listener is not None:
            listener.expect -= unreachable
            found["served"], found["not_served"] = listener.wait(deadline + bandwidth.seconds + 5)
    facts = FabricFacts(ping=have_ping, peers=peers, seconds=round(time.monotonic() - started, 2), **found)
    print(json.dumps(facts.to_json(), sort_keys=True))


main()
