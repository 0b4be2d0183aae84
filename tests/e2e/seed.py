"""A node's Docker data root with the rehearsal image already pulled, to start simulated nodes from.

Every rehearsal module used to bring fresh nodes whose first `up` pulled the image on each of them: about
20 pulls a suite, 10-12 s each on an idle machine and twice that under the suite's load (2026-12-03), for
a step that `test_rehearsal.py` (the README's path) proves on its own nodes. So a test session pulls once,
into a throw-away dockerd of its own (the nodes' storage driver, the registry as an insecure one, as their
daemon.json has it), stops it, and a node that asks for the seed gets a copy of that data root before its
dockerd starts: the image is there with its tag and its repo digest, as a pull leaves it, and the program's
pull step finds it ("is already on this node"). A copy, not links: a node may remove or re-tag the image.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from tests.e2e.image.build import docker, publish
from tests.e2e.image.dockerd import stop_daemon

SEED_RUN_PREFIX = "/run/spark-vllm-seed-"  # the daemon's exec root and socket: short (unix sockets: 107 bytes)


@contextlib.contextmanager
def seed_dockerd(workdir: Path, registry: str):
    """A dockerd of its own (host network namespace) that trusts `registry`; yields its DOCKER_HOST and leaves
    its data root, `workdir/data`, once stopped."""
    run = Path(SEED_RUN_PREFIX + secrets.token_hex(4))
    run.mkdir(parents=True)
    config = workdir / "daemon.json"
    config.write_text(json.dumps({"insecure-registries": [registry]}) + "\n")
    host = f"unix://{run}/docker.sock"
    log = open(workdir / "dockerd.log", "ab")
    process = subprocess.Popen(
        ["dockerd", "--config-file", str(config), "--data-root", str(workdir / "data"), "--exec-root",
         str(run / "exec"), "--pidfile", str(run / "docker.pid"), "-H", host, "--storage-driver", "overlay2",
         "--bridge=none", "--iptables=false", "--ip-masq=false"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "-H", host, "version"], capture_output=True).returncode != 0:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "dockerd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the seed's dockerd did not come up (exit {process.poll()}): {tail}")
            time.sleep(0.2)
        yield host
    finally:
        stop_daemon(process)
        log.close()
        shutil.rmtree(run, ignore_errors=True)


def image_seed(workdir: Path, cache_dir: Path, registry: str) -> Path:
    """A data root holding the rehearsal image as pulled from `registry` (published there first if it is not)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with seed_dockerd(workdir, registry) as host:
        ref = publish(cache_dir, registry, host).ref  # leaves the daemon without it
        docker(host, "pull", "-q", ref, timeout=300)
    return workdir / "data"
