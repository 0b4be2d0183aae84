"""The test suite's own port picker (tests/waiting.py): ports a server binds seconds later must still be free."""

from __future__ import annotations

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
    assert waiting.ephemeral_range() == (1024, 60999)
    assert waiting.port_span() == range(61000, 65536)
