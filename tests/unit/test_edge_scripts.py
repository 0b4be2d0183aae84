"""The edge's two node scripts run for real on this machine, as the container runs them (bash, a real HAProxy on
PATH, the configuration directory in EDGE_DIR): edge_entry.sh, the container's main process that runs HAProxy
and watches it, and edge_apply.sh, the step that writes, checks and reloads a configuration."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from components.plan.edge import archive, key_digest, render
from components.plan.programs import script
from tests import edge_load
from tests.e2e.image.build import haproxy_command
from tests.e2e.rehearsal import CACHE_DIR
from tests.edge_harness import Recorder, edge_spec, exchange, statuses
from tests.waiting import wait_for

KEY, OTHER = "sk-edge-script-key-0001", "sk-edge-script-key-0002"


@pytest.fixture
def node(tmp_path):
    """PATH with `haproxy` (Debian's, unpacked), the edge's directory, a recording upstream."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "haproxy"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(haproxy_command(CACHE_DIR)) + ' "$@"\n')
    wrapper.chmod(0o755)
    edge_dir = tmp_path / "edge"
    edge_dir.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "EDGE_DIR": str(edge_dir), "EDGE_PIDFILE": str(tmp_path / "edge.pid")}
    upstream = Recorder().start()
    yield env, edge_dir, upstream
    upstream.close()


def start_entry(env, interval=1, misses=2) -> subprocess.Popen:
    """The container's main process; its output (HAProxy's too) in EDGE_DIR/../entry.log, as docker logs."""
    log = open(Path(env["EDGE_DIR"]).parent / "entry.log", "w")
    return subprocess.Popen(["bash", "-c", script("edge_entry.sh"), "edge_entry", str(interval), str(misses)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def apply(env, spec, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script("edge_apply.sh"), "edge_apply"],
                          input=stdin or archive(spec, env["EDGE_DIR"]), env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def tar_of(files: dict[str, str]) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return base64.b64encode(buffer.getvalue()).decode()


def chat(port: int, key: str) -> int:
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {key}\r\nContent-Length: 2\r\n"
           "Connection: close\r\n\r\n{}").encode()  # fmt: skip
    found = statuses(exchange(port, raw))
    return found[0] if found else 0


def end(entry: subprocess.Popen) -> None:
    with_children = [entry.pid]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if os.getpgid(int(stat.parent.name)) == entry.pid:
                with_children.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    for pid in with_children:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    entry.wait(10)


def test_the_first_configuration_starts_haproxy_a_new_one_reloads_it_and_the_same_one_changes_nothing(node):
    env, edge_dir, upstream = node
    entry = start_entry(env)
    try:
        spec = edge_spec(upstream, clients=(("client", key_digest(KEY)),))
        first = apply(env, spec)
        assert first.returncode == 0, first.stderr
        assert "configuration written; HAProxy starts with it" in first.stdout and "answering on" in first.stdout
        assert chat(spec.port, KEY) == 200 and chat(spec.port, OTHER) == 401
        rotated = apply(
            env,
            edge_spec(
                upstream, port=spec.port, metrics_port=spec.metrics_port, clients=(("client", key_digest(OTHER)),)
            ),
        )
        assert rotated.returncode == 0 and "configuration reloaded" in rotated.stdout, rotated.stderr
        assert wait_for(lambda: chat(spec.port, OTHER) == 200 and chat(spec.port, KEY) == 401, 10)
        same = apply(
            env,
            edge_spec(
                upstream, port=spec.port, metrics_port=spec.metrics_port, clients=(("client", key_digest(OTHER)),)
            ),
        )
        assert same.returncode == 0 and "configuration unchanged" in same.stdout
        for path in edge_dir.iterdir():  # the program's key, the TLS key: the edge's user's alone
            assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_uid == os.stat("/proc/1").st_uid, path
    finally:
        end(entry)


def test_a_configuration_haproxy_refuses_changes_nothing(node):
    env, edge_dir, upstream = node
    entry = start_entry(env)
    try:
        spec = edge_spec(upstream, clients=(("client", key_digest(KEY)),))
        assert apply(env, spec).returncode == 0
        before = sorted(path.name for path in edge_dir.iterdir())
        broken = apply(env, spec, tar_of({"haproxy.cfg": "frontend x\n    bind nonsense\n", "tls-0.pem": "x"}))
        assert broken.returncode == 1 and "HAProxy refuses the configuration" in broken.stderr
        assert (edge_dir / "haproxy.cfg").read_text() == render(spec).replace("/etc/spark-vllm-edge", str(edge_dir))
        assert sorted(path.name for path in edge_dir.iterdir()) == before  # nothing new left behind
        assert chat(spec.port, KEY) == 200
    finally:
        end(entry)


def test_a_listener_that_accepts_and_never_answers_ends_the_container_for_docker_to_restart(node):
    """A stopped worker: the kernel still completes TCP handshakes on its port (a port check would pass), and
    nothing answers. The watchdog's own HTTP check misses twice and ends it all with a non-zero exit."""
    env, edge_dir, upstream = node
    entry = start_entry(env, interval=1, misses=2)
    try:
        spec = edge_spec(upstream, clients=(("client", key_digest(KEY)),))
        assert apply(env, spec).returncode == 0
        master = int(Path(env["EDGE_PIDFILE"]).read_text())
        workers = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat")
                   if p.read_text().rsplit(")", 1)[1].split()[1] == str(master)]  # fmt: skip
        time.sleep(2)  # a check or two that pass first
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)
        started = time.monotonic()
        assert entry.wait(30) == 1
        output = (edge_dir.parent / "entry.log").read_text()
        assert "HAProxy takes connections and answers none" in output and "(2 of 2)" in output, output
        assert time.monotonic() - started < 20
    finally:
        end(entry)


def test_docker_stop_ends_haproxy_and_exits_0(node):
    env, edge_dir, upstream = node
    entry = start_entry(env)
    spec = edge_spec(upstream)
    assert apply(env, spec).returncode == 0
    master = int(Path(env["EDGE_PIDFILE"]).read_text())
    entry.send_signal(signal.SIGTERM)
    assert entry.wait(15) == 0
    assert wait_for(lambda: not Path(f"/proc/{master}").exists(), 10)


def test_stopped_before_any_configuration_it_exits_0(node):
    env, _, _ = node
    entry = start_entry(env)
    time.sleep(0.5)
    entry.send_signal(signal.SIGTERM)
    assert entry.wait(5) == 0


def test_the_watchdog_cannot_be_turned_on_the_edge_by_crowding_its_ports(node):
    """An address holds every connection the edge's own port gives it and floods the endpoint with idle ones: the
    watchdog's check (its own listener on loopback) misses none, so the edge is never ended for it (#64)."""
    env, edge_dir, upstream = node
    entry = start_entry(env, interval=1, misses=2)
    loads = []
    try:
        spec = edge_spec(upstream, clients=(("client", key_digest(KEY)),), max_connections=32)
        assert apply(env, spec).returncode == 0
        own = edge_load.Target(spec.metrics_host, spec.metrics_port)
        endpoint = edge_load.Target("127.0.0.1", spec.port)
        loads = [edge_load.start(edge_load.idle_connections(100), own, "127.0.0.3")]
        loads += [edge_load.start(edge_load.idle_connections(100), endpoint, f"127.0.0.{n}") for n in (5, 6, 7)]
        time.sleep(8)  # eight checks under the crowd
        assert entry.poll() is None
        assert "no answer from the edge's own check" not in (edge_dir.parent / "entry.log").read_text()
        assert loads[0].tallies[0].held == 8  # the own port's share for one address
    finally:
        for load in loads:
            load.stop()
        end(entry)
