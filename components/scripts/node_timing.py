"""Retry, backoff and timed checks, written once for every node program: the supervisor's parts (Ray, the GPU turn,
vLLM's restarts, the memory waits, the watch) and the router's keeper. Times are `time.monotonic()` seconds the
caller passes in, so that each part is tested with the clock it is given. Standard library only, Python 3.7."""

import collections
import time


class Every:
    """A check made at most once every `seconds`: `due(now)` says whether it is time, and if it is, the next one is
    counted from now. Also a note said at most so often (`Every(30)`: a waiting line every 30 s)."""

    def __init__(self, seconds, first=0.0):
        self.seconds = seconds
        self.at = first  # when it is next due

    def due(self, now, seconds=None):
        """Whether the check is due at `now`; if so the next is `seconds` (the usual interval) from now."""
        if now < self.at:
            return False
        self.at = now + (self.seconds if seconds is None else seconds)
        return True

    def by(self, at):
        """Due at `at` at the latest (sooner than planned: vLLM writes its metadata while it starts)."""
        self.at = min(self.at, at)

    def now(self):
        """Due at the next look."""
        self.at = 0.0

    def never(self):
        """Not due again until `now()` or `by()` says otherwise."""
        self.at = float("inf")


class Backoff:
    """Doubling delays: `delay(1)` is `first`, each attempt after it twice the one before, never over `most`."""

    def __init__(self, first, most):
        self.first, self.most = first, most

    def delay(self, attempt):
        return min(self.first * 2 ** min(max(attempt, 1) - 1, 32), self.most)


class Window:
    """Times something happened within the last `seconds` (vLLM's exits, for recovery.maxRestarts)."""

    def __init__(self):
        self.times = collections.deque()

    def add(self, now, seconds):
        """Counts one at `now`, forgets those older than `seconds`; how many are left."""
        self.times.append(now)
        while self.times and now - self.times[0] > seconds:
            self.times.popleft()
        return len(self.times)

    def clear(self):
        self.times.clear()

    def __len__(self):
        return len(self.times)


def polls(seconds, every):
    """Tries for `seconds`, `every` seconds apart: yields the seconds elapsed before each try, the first at once, none
    once `seconds` have passed. `for _ in polls(60, 0.5): if done(): break` (the loop's `else`: not in time)."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= seconds:
            return
        yield elapsed
        time.sleep(every)
