"""The stand-in's multi-node mp executor: what vLLM does with ``--nnodes N --node-rank R
--master-addr A --master-port P`` (``--headless`` on ranks above 0), without a model.

Rank 0 binds the master address (it must be an address of this node: a wrong one fails to bind, as
torch's store does) and waits until every other rank has connected and introduced itself (its rank,
the node count, its VLLM_HOST_IP); only then does it load and serve. A rank with a wrong master
address never arrives, a duplicate or out-of-range rank is refused, and rank 0 gives up after
``STANDIN_JOIN_TIMEOUT_S`` (120 s) naming the ranks it is missing. While serving, each of rank 0's engine
steps is a collective over every rank's connection: one that goes away is a dead engine (/health 503, exit
1), one that does not answer (stopped, or the "hang" fault) holds every step for good with /health 200, as
vLLM's workers wait in NCCL; a worker whose master goes away exits 1 too, so the ranks restart together.
Pure standard library.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time

from . import log
from .api import fault
from .args import ServeConfig, StandinError

WHERE = "multiproc_executor.py:112"


class PeerLostError(Exception):
    pass


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _receive(reader, what: str) -> dict:
    line = reader.readline()
    if not line:
        raise PeerLostError(f"{what} closed the connection")
    return json.loads(line)


class MpEngine:
    def __init__(self, cfg: ServeConfig, environ=os.environ):
        self.cfg = cfg
        self.environ = environ
        self.host_ip = environ.get("VLLM_HOST_IP", "").strip() or "0.0.0.0"
        self.peers: dict[int, tuple] = {}  # rank 0: rank -> (socket, reader, its VLLM_HOST_IP)
        self.master: socket.socket | None = None  # the other ranks: the connection to rank 0
        self.lost = threading.Event()
        self._lock = threading.Lock()

    # -- start ---------------------------------------------------------------
    def start(self, stop: threading.Event, timeout_s: float) -> None:
        if self.cfg.node_rank == 0:
            self._accept_ranks(stop, timeout_s)
        else:
            self._join_master(stop, timeout_s)

    def _accept_ranks(self, stop: threading.Event, timeout_s: float) -> None:
        cfg = self.cfg
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((cfg.master_addr, cfg.master_port))
        except OSError as e:
            server.close()
            raise StandinError(
                f"The server socket has failed to bind to {cfg.master_addr}:{cfg.master_port} "
                f"(errno: {e.errno} - {e.strerror}). --master-addr must be this node's address."
            ) from e
        server.listen(16)
        server.settimeout(0.5)
        log.info(
            WHERE, "rank 0 waiting for %d other node(s) at %s:%d", cfg.nnodes - 1, cfg.master_addr, cfg.master_port
        )
        deadline = time.monotonic() + timeout_s
        try:
            while len(self.peers) < cfg.nnodes - 1:
                if stop.is_set():
                    return
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, cfg.nnodes)) - set(self.peers))
                    raise StandinError(
                        f"Timed out after {timeout_s:g} s waiting for node ranks {missing} to connect to "
                        f"{cfg.master_addr}:{cfg.master_port} (check --master-addr, --node-rank and the fabric link)"
                    )
                try:
                    sock, address = server.accept()
                except TimeoutError:
                    continue
                self._admit(sock, address)
        finally:
            server.close()
        log.info(
            WHERE,
            "all %d node(s) joined: %s",
            cfg.nnodes,
            ", ".join(f"rank {r} -> {self.peers[r][2]}" for r in sorted(self.peers)),
        )

    def _admit(self, sock: socket.socket, address) -> None:
        sock.settimeout(10)
        reader = sock.makefile("rb")
        try:
            hello = _receive(reader, f"a node at {address[0]}")
        except (PeerLostError, OSError, ValueError):
            sock.close()
            return
        rank, problem = hello.get("rank"), None
        if hello.get("nnodes") != self.cfg.nnodes or hello.get("world") != self.cfg.world_size:
            problem = (
                f"rank {rank} from {address[0]} expects --nnodes {hello.get('nnodes')} and world size "
                f"{hello.get('world')}, rank 0 has {self.cfg.nnodes} and {self.cfg.world_size}"
            )
        elif not isinstance(rank, int) or not 0 < rank < self.cfg.nnodes:
            problem = f"node rank {rank} from {address[0]} is not in 1..{self.cfg.nnodes - 1}"
        elif rank in self.peers:
            problem = f"node rank {rank} from {address[0]} already joined from {self.peers[rank][2]}"
        if problem:
            log.error(WHERE, "%s: refused", problem)
            _send(sock, {"error": problem})
            sock.close()
            return
        _send(sock, {"ok": True})
        sock.settimeout(None)
        self.peers[rank] = (sock, reader, hello.get("ip") or address[0])
        log.info(WHERE, "node rank %d joined from %s (VLLM_HOST_IP %s)", rank, address[0], hello.get("ip"))

    def _join_master(self, stop: threading.Event, timeout_s: float) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + timeout_s
        last = None
        while not stop.is_set():
            if time.monotonic() > deadline:
                raise StandinError(
                    f"node rank {cfg.node_rank} could not reach rank 0 at {cfg.master_addr}:{cfg.master_port} "
                    f"within {timeout_s:g} s: {last}"
                )
            try:
                sock = socket.create_connection((cfg.master_addr, cfg.master_port), timeout=2)
                break
            except OSError as e:
                last = e
                time.sleep(0.5)
        else:
            return
        hello = {"rank": cfg.node_rank, "nnodes": cfg.nnodes, "world": cfg.world_size, "ip": self.host_ip}
        _send(sock, hello)
        reader = sock.makefile("rb")
        try:
            answer = _receive(reader, "rank 0")
        except (PeerLostError, OSError, ValueError) as e:
            raise StandinError(
                f"rank 0 at {cfg.master_addr}:{cfg.master_port} dropped node rank {cfg.node_rank}: {e}"
            ) from e
        if answer.get("error"):
            raise StandinError(f"rank 0 refused node rank {cfg.node_rank}: {answer['error']}")
        sock.settimeout(None)
        self.master = sock
        log.info(WHERE, "node rank %d joined rank 0 at %s:%d", cfg.node_rank, cfg.master_addr, cfg.master_port)
        threading.Thread(target=self._answer_pings, args=(sock, reader), name="mp-master", daemon=True).start()

    def _answer_pings(self, sock: socket.socket, reader) -> None:
        try:
            while True:
                message = _receive(reader, "rank 0")
                while fault(self.environ) == "hang":  # this rank stuck: rank 0's step waits on it
                    time.sleep(0.05)
                if message.get("ping"):
                    _send(sock, {"pong": True})
        except (PeerLostError, OSError, ValueError) as e:
            log.error(WHERE, "lost rank 0 (%s): this worker's engine is dead", e)
            self.lost.set()

    # -- while serving ---------------------------------------------------------
    collective = True  # every step of rank 0's engine needs every rank (core.py _run)

    def step(self, stop: threading.Event) -> bool:
        """Rank 0: one engine step, in which every rank takes part: True once each answered, False when told to stop
        meanwhile, PeerLostError when a rank went away (its connection closed). A rank that does not answer (a
        stopped process, a rank stuck) holds the step for good, as vLLM's workers wait in NCCL's collectives for
        every rank: no timeout, no error, /health still 200. The other ranks: PeerLostError once rank 0 is gone."""
        if self.cfg.node_rank != 0:
            if self.lost.is_set():
                raise PeerLostError("rank 0 went away")
            return True
        with self._lock:
            peers = list(self.peers.items())
            try:
                for _, (sock, _, _) in peers:
                    _send(sock, {"ping": True})
                for rank, (sock, reader, ip) in peers:
                    while not select.select([sock], [], [], 0.5)[0]:
                        if stop.is_set():
                            return False
                    _receive(reader, f"node rank {rank} ({ip})")
            except (OSError, ValueError) as e:
                raise PeerLostError(f"a node rank went away: {e}") from e
        return True

    def ping(self, timeout_s: float) -> None:
        """Rank 0: raises PeerLostError when a rank does not answer; the other ranks: when rank 0 is gone."""
        if self.cfg.node_rank != 0:
            if self.lost.is_set():
                raise PeerLostError("rank 0 went away")
            return
        with self._lock:
            for rank, (sock, reader, ip) in list(self.peers.items()):
                try:
                    sock.settimeout(timeout_s)
                    _send(sock, {"ping": True})
                    _receive(reader, f"node rank {rank} ({ip})")
                except (OSError, ValueError, PeerLostError) as e:
                    raise PeerLostError(f"node rank {rank} ({ip}) went away: {e}") from e

    @staticmethod
    def is_actor_death(exc: BaseException) -> bool:
        return isinstance(exc, PeerLostError)

    def shutdown(self) -> None:
        with self._lock:
            for sock, _, _ in self.peers.values():
                try:
                    sock.close()
                except OSError:
                    pass
            self.peers = {}
            if self.master is not None:
                try:
                    self.master.close()
                except OSError:
                    pass
                self.master = None
