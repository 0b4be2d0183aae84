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

from pathlib import Path

from tests.e2e.image.build import docker, publish
from tests.e2e.image.dockerd import private_dockerd


def image_seed(workdir: Path, cache_dir: Path, registry: str) -> Path:
    """A data root holding the rehearsal image as pulled from `registry` (published there first if it is not)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {"insecure-registries": [registry], "storage-driver": "overlay2"}  # as the nodes' daemon.json and flag
    with private_dockerd("seed-", data_root=workdir / "data", config=config) as host:
        ref = publish(cache_dir, registry, host).ref  # leaves the daemon without it
        docker(host, "pull", "-q", ref, timeout=300)
    return workdir / "data"
