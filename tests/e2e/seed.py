"""A node's Docker data root with the rehearsal image already pulled, to start simulated nodes from.

Every rehearsal module used to bring fresh nodes whose first `up` pulled the image on each of them: about
20 pulls a suite, 10-12 s each on an idle machine and twice that under the suite's load (2026-12-03), for
a step that `test_rehearsal.py` (the README's path) proves on its own nodes. So the image is pulled once,
into a throw-away dockerd (the nodes' storage driver, the registry as an insecure one, as their daemon.json
has it), which is stopped, and a node that asks for the seed starts from that data root (tests/e2e/nodes.py
`_plant_seed`: the image's layers as hard links, which dockerd never writes into, and the metadata a node
changes when it removes or re-tags the image copied): the image is there with its tag and its repo digest,
as a pull leaves it, and the program's pull step finds it ("is already on this node").

The seed is kept in the rehearsal's cache, keyed by the image's content hash and the registry's address
(the tag and the repo digest name it; each test process's registry takes the same address run after run
when it is free: tests/e2e/conftest.py), and built under a lock of its own: later runs start from it instead
of each process pulling into a daemon of its own (about 12 s of CPU and 20 s at the start of each process,
2026-12-04). Seeds of another image unused for an hour, and any unused for two days, are removed when one is
made. A seed holds one build of the image: when the archive is built again (the cache keeps one archive, so a
rehearsal of another commit evicts it, and a new build of the same sources has another id), the seed is made
again, or its nodes would run the older build beside nodes that pull the newer one ("the image differs between
nodes", seen in CI on 2026-12-04).
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.e2e.image.build import _archive_id, _locked, content_hash, docker, publish, safe_rmtree
from tests.e2e.image.dockerd import private_dockerd


def image_seed(cache_dir: Path, registry: str) -> Path:
    """A data root holding the rehearsal image as pulled from `registry` (published there first if it is not)."""
    seeds, image = Path(cache_dir) / "seeds", content_hash()
    made = seeds / f"{image}-{registry.replace(':', '-')}"
    with _locked(seeds / f"{made.name}.lock"):
        if _seeded_id(made) and _seeded_id(made) == _archive_id(Path(cache_dir).resolve()):
            (made / "complete").touch()  # in use: kept by the pruning below
            return made / "data"
        for old in seeds.iterdir():
            # another suite may be planting a seed of another image right now (a clone of another commit):
            # taken at each process's start, a seed in use was touched within the hour
            idle = 3600 if not old.name.startswith(f"{image}-") else 2 * 86400
            stale = _unused_for(old / "complete", idle)
            if old.is_dir() and old != made and stale:
                with _locked(seeds / f"{old.name}.lock"):  # its build, if one is under way, ends first
                    if _unused_for(old / "complete", idle):
                        safe_rmtree(old)
        safe_rmtree(made)
        config = {"insecure-registries": [registry], "storage-driver": "overlay2"}  # as the nodes' daemon.json
        with private_dockerd("seed-", data_root=made / "data", config=config) as host:
            published = publish(cache_dir, registry, host)  # leaves the daemon without it
            docker(host, "pull", "-q", published.ref, timeout=300)
        (made / "complete").write_text(f"{published.ref}\n{published.image_id}\n")
    return made / "data"


def _seeded_id(made: Path) -> str:
    """The image id the seed at `made` holds ("" for none, or a seed made before it said which)."""
    try:
        lines = (made / "complete").read_text().split()
    except OSError:
        return ""
    return lines[1] if len(lines) > 1 else ""


def _unused_for(marker: Path, seconds: float) -> bool:
    try:
        return time.time() - marker.stat().st_mtime > seconds
    except OSError:
        return True  # never completed: a build that was cut short
