"""The supervisor's side of the node's GPU turn (node_gpu_turn.py has the turn itself): taken just before vLLM
starts, given back once vLLM serves (a rank without an API server: once it has its KV cache), exits, or outlasts
its hold limit (vllm.readyTimeoutSeconds); while another holds it, who that is and since when. Its neighbours on
the node are told what this replica asks of the GPU and how it is doing (Tenant), and asked the same when a start
did not get its memory. Standard library only."""

from components.scripts.node_contract import VllmState
from components.scripts.node_gpu_turn import (
    GpuTurn,
    Tenant,
    TurnDirectoryError,
    describe_holder,
    hold_limit,
    turn_directory,
    turn_wait_bound,
)
from components.scripts.node_log import say
from components.scripts.node_timing import Every

TURN_HOLD_SECONDS = 1800  # vllm.readyTimeoutSeconds' default, for a single-model stack's spec that names none
WAITING_NOTE_SECONDS = 30
CHECK_SECONDS = 1  # how often the holder looks whether to give the turn back


class TurnKeeper:
    def __init__(self, node, directory, refused_directory):
        self.node = node
        self.problem = None  # the turn's directory refused: no vLLM starts (status.json says why)
        try:
            turn_directory(directory)
        except TurnDirectoryError as refused:
            self.problem, directory = str(refused), refused_directory  # a turn of its own, never taken
        self.turn = GpuTurn(directory)
        self.tenant = Tenant(directory)  # what this supervisor tells its neighbours on the node
        self.waiting = None  # since when this supervisor waits for the turn
        self.holder = None  # who holds it meanwhile, as it answered
        self.holder_limit = None  # how long it may hold it, as it answered
        self.overdue = None  # started without the turn: its holder kept it past its limit (why, for status.json)
        self.kept = False  # held from vLLM's start until now (not given back at the hold limit)
        self.notes = Every(WAITING_NOTE_SECONDS)
        self.checks = Every(CHECK_SECONDS)

    @property
    def held(self):
        return self.turn.held

    def take(self, now, tenancy):
        """Whether vLLM may start now: this supervisor holds the turn, or its holder kept it past the longest any
        supervisor of the stack may (a holder stopped or hung: not worth waiting for)."""
        limit = limit_of(tenancy)
        identity = {"node": self.node, "replica": tenancy.replica if tenancy else None, "why": "starting vLLM",
                    "hold_seconds": limit}  # fmt: skip
        if self.turn.take(identity):
            if self.waiting is not None:
                say(f"took the node's GPU turn after waiting {now - self.waiting:.0f} s for {self.holder}")
            self.waiting, self.holder, self.overdue = None, None, None
            return True
        if self.waiting is None:
            self.waiting = now
            self.notes.now()
        if self.notes.due(now):
            holder = self.turn.holder()
            self.holder, self.holder_limit = describe_holder(holder), hold_limit(holder)
            say(
                f"waiting for the node's GPU turn ({now - self.waiting:.0f} s): held by {self.holder}; "
                "vLLMs sharing a GPU start one at a time, so that none counts another's memory as its own"
            )
        bound = turn_wait_bound(max(limit, self.holder_limit or 0))
        if now - self.waiting > bound:
            if self.overdue is None:
                self.overdue = (
                    f"{self.holder} kept the node's GPU turn over {bound:.0f} s, longer than any supervisor of "
                    "this stack may: vLLM starts without it"
                )
                say(self.overdue)
            return True
        return False

    def started(self):
        """vLLM started: whether it had the turn for all of its start is known from here."""
        self.kept = self.turn.held

    def keep(self, now, tenancy, running, serving, has_kv_cache):
        """Answers who holds the turn; gives it back once vLLM serves (`has_kv_cache()`, asked of a rank without an
        API server), when it is gone, or at the hold limit."""
        if not self.turn.held:
            return
        self.turn.answer()
        if not running:
            self.give_back("vLLM is not running")
            return
        if not self.checks.due(now):
            return
        limit = limit_of(tenancy)
        if serving:
            self.give_back("vLLM serves")
        elif has_kv_cache():
            self.give_back("this rank has its KV cache")
        elif now - self.turn.since > limit:
            self.kept = False
            self.give_back(f"vLLM did not serve within {limit:g} s of taking it (vllm.readyTimeoutSeconds)")

    def give_back(self, why=None):
        if self.turn.held:
            self.turn.give_back()
            if why:
                say(f"gave the node's GPU turn back: {why}")

    def said(self):
        """status.json's `turn`: held, waiting (for whom), started without it (why), or None."""
        if self.turn.held:
            return "held"
        if self.overdue:
            return f"without: {self.overdue}"
        return f"waiting: held by {self.holder}" if self.waiting is not None else None

    def tell(self, replica, gpu_memory_utilization, state, started):
        """What the node's other supervisors learn of this one when the GPU's memory is in question."""
        self.tenant.tell(
            {"node": self.node, "replica": replica, "gpu_memory_utilization": gpu_memory_utilization,
             "state": state, "started": started}
        )  # fmt: skip

    def neighbours(self):
        return self.tenant.neighbours()

    def busy_neighbours(self, started):
        """The node's other replicas that started, or were starting, stopping or waiting, while this vLLM started
        (at wall-clock `started`): their memory moved under its profiling."""
        found = []
        for neighbour in self.tenant.neighbours():
            who = neighbour.get("replica") or "another vLLM"
            since = neighbour.get("started")
            if started is not None and since is not None and since >= started - 1:
                found.append(f"{who} started")
            elif neighbour.get("state") in (VllmState.STARTING, VllmState.BACKOFF):  # loading, or just gone: it moved
                found.append(f"{who} was {neighbour['state']}")
        return found

    def close(self):
        self.turn.give_back()
        self.tenant.close()


def limit_of(tenancy):
    """How long a start may hold the turn: vllm.readyTimeoutSeconds, rendered into the spec's tenancy."""
    return tenancy.turn_hold_seconds if tenancy else TURN_HOLD_SECONDS
