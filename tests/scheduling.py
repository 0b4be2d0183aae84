"""How ./run-tests hands its tests to its processes (pytest-xdist, --dist load): the fast lane's, and the full run's.

Ten processes share two cores because most of the lane's long tests wait on timers and processes; the run is quick
only while a few processes compute as the others wait. Handed out in advance, the waits bunched: work stealing's
runs of consecutive tests put the files that wait on half the processes and the program's tests on the others; with
the long waits dealt first, all ten processes started with a wait and the cores sat a third to four fifths idle for
ten seconds after the collection, and the run ended on one process's last waits (2026-12-07/08). `CappedWaits` hands
tests out as processes free up, from one queue (xdist's load scheduling: a process holds the test it runs and the
next one):

- the long waits (`LONG_WAITS`, longest first) go out before anything else, but to at most two fifths of the
  processes at once and never two to one process, so the rest keep the cores busy;
- the files that wait more than they compute alternate with the others in proportion, so that both run out together
  and the last minutes are not all waiting;
- a hand-out is a run of consecutive tests of one file (a module's fixtures set up once for it), at most `chunk`
  and smaller as the queue empties, so that the processes end within a few seconds of each other.

The full run (./run-tests) hands out the rehearsal's modules whole (`whole`: their tests share the module's
simulated nodes and run in order in one process), longest first and before anything else, to at most
`whole_at_once` processes at once (a process that finishes one takes the next itself), and the fast lane's tests as
above to the others and to each process once the modules run out. Handed out as whole files too, the fast lane's
files that wait ran side by side once the rehearsal's modules thinned out, and the cores sat 75 CPU-s idle in
minutes 9 to 12 of a 760 s run (2026-12-07).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Optional

from xdist.scheduler.load import LoadScheduling

WAITING_SHARE = 0.4  # at most this share of the processes in a long wait at once (4 of 10)


def is_listed(nodeid: str, names: Iterable[str]) -> bool:
    """A test's id is listed as itself, or by its function's id for every one of its parameters."""
    return any(nodeid == name or nodeid.startswith(name + "[") for name in names)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class CappedWaits(LoadScheduling):
    """xdist's load scheduling with the queue in four parts: the files `whole` says go out whole, in collection
    order; `waits` (their names, longest first); the tests of `waiting_files`; and the rest (module docstring)."""

    def __init__(self, config, log=None, *, waits: Sequence[str] = (), waiting_files: Iterable[str] = (),
                 whole: Callable[[str], bool] = lambda path: False, whole_at_once: Optional[int] = None,
                 chunk: int = 16) -> None:  # fmt: skip
        super().__init__(config, log)
        self.listed = tuple(waits)
        self.waiting_files = frozenset(waiting_files)
        self.is_whole = whole
        self.whole_at_once = whole_at_once  # at most so many processes in a whole file at once (None: any)
        self.chunk = chunk
        self.whole: list[list[int]] = []  # the whole files not handed out: each its tests' indices
        self.in_whole: dict = {}  # a process: what it holds of whole files, while it holds any
        self.waits: list[int] = []  # the long waits not handed out, longest first
        self.slow: list[int] = []  # the waiting files' other tests, in collection order
        self.totals = (1, 1)  # how many tests self.slow and self.pending began with
        self.in_wait: dict = {}  # a process: the long wait it holds, while it holds one

    @property
    def queued(self) -> bool:
        return bool(self.whole or self.waits or self.slow or self.pending)

    @property
    def tests_finished(self) -> bool:
        return not self.queued and super().tests_finished

    @property
    def has_pending(self) -> bool:
        return self.queued or super().has_pending

    def schedule(self) -> None:
        if self.collection is not None:  # a later call (a process added): as load scheduling does
            super().schedule()
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        rank = {}  # a listed test's index: its place in `waits`
        for index, nodeid in enumerate(self.collection):
            place = next((place for place, name in enumerate(self.listed) if is_listed(nodeid, (name,))), None)
            if place is not None:
                rank[index] = place
        whole: dict[str, list[int]] = {}
        for index, nodeid in enumerate(self.collection):
            if self.is_whole(file_of(nodeid)):
                whole.setdefault(file_of(nodeid), []).append(index)
        self.whole = list(whole.values())
        self.waits = sorted((index for index in rank if not self.is_whole(file_of(self.collection[index]))),
                            key=lambda index: (rank[index], index))  # fmt: skip
        taken = set(self.waits).union(*self.whole)
        rest = [index for index in range(len(self.collection)) if index not in taken]
        self.slow = [index for index in rest if file_of(self.collection[index]) in self.waiting_files]
        slow = set(self.slow)
        self.pending[:] = [index for index in rest if index not in slow]
        self.totals = (max(1, len(self.slow)), max(1, len(self.pending)))
        for node in self.nodes:
            self.check_schedule(node)

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        if self.in_wait.get(node) == item_index:
            del self.in_wait[node]
        held = self.in_whole.get(node)
        if held is not None:
            held.discard(item_index)
            if not held:
                del self.in_whole[node]
        super().mark_test_complete(node, item_index, duration)
        self.check_waiting(node)

    def remove_node(self, node):
        self.in_wait.pop(node, None)  # a process gone: what it held goes back to the queue (load scheduling's)
        self.in_whole.pop(node, None)
        crashed = super().remove_node(node)
        self.check_waiting(node)
        return crashed

    def check_waiting(self, done) -> None:
        """The processes other than `done` that hold fewer than two tests (one waiting for a whole file's turn, or
        for the end): handed what they may take now, or told to end."""
        for node in self.nodes:
            if node is not done and len(self.node2pending[node]) < 2:
                self.check_schedule(node)

    def check_schedule(self, node, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if not self.queued:
            node.shutdown()  # it runs what it holds, then ends
            return
        while len(self.node2pending[node]) < 2 and self.queued:
            sent = self.next_for(node)
            if not sent:
                break  # only whole files left, none this process may take now: it waits for a turn
            self.node2pending[node].extend(sent)
            node.send_runtest_some(sent)

    def take_wait(self, node) -> list[int]:
        """The next long wait for `node`, counted as its own until it ends (a second one replaces the first in the
        count, and its end leaves the second counted)."""
        self.in_wait[node] = self.waits[0]
        return [self.waits.pop(0)]

    def next_for(self, node) -> list[int]:
        """What `node` is handed next, taken out of the queue: a whole file, a long wait, or a run of one file's
        tests."""
        if self.whole and (node in self.in_whole or len(self.in_whole) < (self.whole_at_once or len(self.nodes))):
            self.in_whole.setdefault(node, set()).update(self.whole[0])  # a process in one takes the next itself
            return self.whole.pop(0)
        if not (self.waits or self.slow or self.pending):
            return []
        cap = max(1, int(len(self.node2pending) * WAITING_SHARE))
        if self.waits and node not in self.in_wait and (len(self.in_wait) < cap or not (self.slow or self.pending)):
            return self.take_wait(node)
        slow_left, rest_left = len(self.slow) / self.totals[0], len(self.pending) / self.totals[1]
        source = self.slow if self.slow and (slow_left >= rest_left or not self.pending) else self.pending
        if not source:  # only long waits left, and this process holds one: a second after it
            return self.take_wait(node)
        left = len(self.slow) + len(self.pending)
        size = max(1, min(self.chunk, left // (2 * len(self.node2pending))))
        first = file_of(self.collection[source[0]])
        taken = 0
        while taken < min(size, len(source)) and file_of(self.collection[source[taken]]) == first:
            taken += 1
        sent, source[:taken] = source[:taken], []
        return sent
