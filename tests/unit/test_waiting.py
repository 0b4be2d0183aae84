"""The suite's own helpers (tests/waiting.py): waits that say what they waited for, and ports that stay free."""

from __future__ import annotations

import itertools
import socket

import pytest

from tests import waiting


def test_ports_come_from_outside_the_ephemeral_range_where_outgoing_connections_take_theirs():
    low, high = waiting.ephemeral_range()
    ports = waiting.free_ports(20)
    assert len(set(ports)) == 20
    assert all(not low <= port <= high for port in ports)
    assert waiting.free_port() not in ports  # never handed out twice by one process


def test_consecutive_ports_follow_each_other():
    first, second, third = waiting.free_ports(3, consecutive=True)
    assert (second, third) == (first + 1, first + 2)


def test_a_port_a_listener_holds_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(waiting, "port_span", lambda: range(port, port + 1))
        with pytest.raises(RuntimeError, match="no 1 free port"):
            waiting.free_ports()
        assert not waiting.bindable(port)


def test_a_range_that_starts_too_low_sends_ports_above_it(tmp_path, monkeypatch):
    proc = tmp_path / "ip_local_port_range"
    proc.write_text("1024\t60999\n")
    read = waiting.ephemeral_range
    monkeypatch.setattr(waiting, "ephemeral_range", lambda: read(str(proc)))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert waiting.ephemeral_range() == (1024, 60999)
    assert waiting.port_span() == range(61000, 65536)


def test_each_xdist_worker_picks_ports_from_a_slice_no_other_worker_picks_from():
    span = range(20000, 32768)
    slices = [waiting.worker_slice(span, f"gw{n}", "6") for n in range(6)]
    assert all(len(part) == len(span) // 6 for part in slices)
    assert all(a.stop <= b.start for a, b in zip(slices, slices[1:], strict=False))  # disjoint, in order
    assert slices[0].start == span.start and slices[-1].stop <= span.stop
    for worker, count in ((None, None), ("master", "6"), ("gw1", None), ("gw1", "x")):
        assert waiting.worker_slice(span, worker, count) == span  # not under xdist: the whole span


def test_a_worker_hands_out_ports_of_its_own_slice_only(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    mine = waiting.port_span()
    assert all(port in mine for port in waiting.free_ports(10))


def test_a_wait_returns_the_first_true_value_and_treats_the_errors_named_as_not_yet():
    calls = itertools.count()

    def check():
        n = next(calls)
        if n < 2:
            raise ConnectionError("coming back")
        return n >= 3 and {"state": "running"}

    assert waiting.wait_until(check, 5, "the daemon back", every=0.01, errors=(ConnectionError,)) == {
        "state": "running"
    }


def test_a_wait_that_runs_out_says_what_it_waited_for_and_what_it_saw_last():
    with pytest.raises(AssertionError, match=r"waited 0.2 s for node-2's supervisor 'running'; last seen: starting"):
        waiting.wait_until(lambda: False, 0.2, "node-2's supervisor 'running'", every=0.05, seen=lambda: "starting")
    with pytest.raises(AssertionError, match="last seen: ConnectionError: refused"):
        waiting.wait_until(lambda: (_ for _ in ()).throw(ConnectionError("refused")), 0.1, "x", errors=(OSError,))
    with pytest.raises(KeyError):  # an error not named is a failure at once
        waiting.wait_until(lambda: {}["missing"], 5, "x", errors=(OSError,))


def test_holds_for_fails_the_moment_what_should_not_happen_happens():
    waiting.holds_for(lambda: True, 0.2, "nothing", every=0.05)
    calls = itertools.count()
    with pytest.raises(AssertionError, match="no Ray start stopped holding after"):
        waiting.holds_for(lambda: next(calls) < 2, 5, "no Ray start", every=0.05)
