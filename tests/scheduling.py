"""How the fast lane hands its tests to its processes (./run-tests --fast: pytest-xdist, --dist worksteal).

Work stealing splits the collection into one run of consecutive tests a process, and a process that runs out takes
the second half of the longest queue left. A test that waits 15 s on timers then starts wherever the split put it:
the three longest of the fast lane started 79 to 83 s into a 96 s run, and the other processes had ended at 85 s
(2026-12-07, `benchmarks.suite_time --fast --cpu`). `LongWaitsFirst` deals the tests named `first` to the processes
in turn, longest first, and spreads each process's through its share of the rest; the rest is split and stolen as
before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from xdist.scheduler.worksteal import WorkStealingScheduling

WAITS_WITHIN = 0.6  # the part of a process's share its long waits start in


def is_listed(nodeid: str, names: Iterable[str]) -> bool:
    """A test's id is listed as itself, or by its function's id for every one of its parameters."""
    return any(nodeid == name or nodeid.startswith(name + "[") for name in names)


def first_then_split(collection: Sequence[str], first: Sequence[str], processes: int) -> list[list[int]]:
    """Per process, the indices of the tests it is handed at the start: an even share of the rest as a consecutive
    run in collection order, with the listed ones dealt to the processes in turn in the list's order (longest first)
    and spread through the first WAITS_WITHIN of each share, a process's later in its gaps than the one's before it
    (the first process's first at its start, the second's a tenth of a gap in with ten processes, and so on): so that
    a few processes wait while the others keep the cores busy. All at the start, they left the cores a fifth idle in
    the first minute: ten processes waiting at once (2026-12-07); each process's first at its start, a third to
    four fifths idle in the ten seconds after the collection (2026-12-08). The end of a share is the part stolen last:
    tests that use the CPU, so that the last seconds of the run are not one process waiting on a timer."""
    dealt: list[list[int]] = [[] for _ in range(processes)]
    rank = {}  # a listed test's index: its place in `first`
    for index, nodeid in enumerate(collection):
        place = next((place for place, name in enumerate(first) if is_listed(nodeid, (name,))), None)
        if place is not None:
            rank[index] = place
    for turn, index in enumerate(sorted(rank, key=lambda index: (rank[index], index))):
        dealt[turn % processes].append(index)
    rest = [index for index in range(len(collection)) if index not in rank]
    plan = []
    for position, mine in enumerate(dealt):
        size = len(rest) // (processes - position)
        share, rest = rest[:size], rest[size:]
        phase = position / processes
        places = [int(len(share) * WAITS_WITHIN * (turn + phase) / len(mine)) for turn in range(len(mine))]
        for index, place in reversed(list(zip(mine, places, strict=True))):
            share.insert(place, index)
        plan.append(share)
    return plan


class LongWaitsFirst(WorkStealingScheduling):
    """Work stealing whose first hand-out is `first_then_split`'s."""

    def __init__(self, config, log=None, *, first: Sequence[str] = ()) -> None:
        super().__init__(config, log)
        self.first = tuple(first)

    def schedule(self) -> None:
        if self.collection is not None or not self.first:
            super().schedule()  # a later call (a process added), or nothing listed: as work stealing does
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        collection = next(iter(self.node2collection.values()))
        nodes = [node for node in self.node2pending if not node.shutting_down]
        if not collection or not nodes:
            super().schedule()  # nothing to deal: work stealing's own first hand-out
            return
        self.collection = collection
        for node, indices in zip(nodes, first_then_split(collection, self.first, len(nodes)), strict=True):
            if indices:
                self.node2pending[node].extend(indices)
                node.send_runtest_some(indices)
        self.pending[:] = []
        self.check_schedule()  # a process handed fewer than two tests is idle: it steals, or ends
