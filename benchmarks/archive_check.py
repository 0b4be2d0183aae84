"""What the image receiver's archive check (components/scripts/node_image_archive.py, #58) costs on the copy's path.

    venv/bin/python -m benchmarks.archive_check [--layer-mib 512] [--rounds 5]

A `docker save`-shaped archive (tests/image_archives.py: one layer of `--layer-mib` random bytes) goes through the
receiver's loop in the copy's 4 MiB frames twice per round, in turn: once as before the check (each frame copied to
bytes, what the body generator yields to `docker load`), once through ArchiveCheck then copied the same way. Prints
both throughputs' medians and their ratio (target: the check keeps at least 0.9 of the copy's own pace; the image
copy on a node is bound by `docker load` far below either: docs/measurements.md). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from components.plan.programs import script
from components.scripts.node_copy_channel import FRAME
from tests.image_archives import config_for, image_id, legacy


def checker() -> dict:
    space: dict = {}
    exec(compile(script("node_image_archive.py"), "node_image_archive", "exec"), space)  # noqa: S102 - our script
    return space


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = config_for("benchmark")
    archive = memoryview(legacy(config, os.urandom(args.layer_mib << 20)))
    space, wanted = checker(), image_id(config)

    def plain() -> float:
        started = time.perf_counter()
        for at in range(0, len(archive), FRAME):
            bytes(archive[at : at + FRAME])
        return time.perf_counter() - started

    def checked() -> float:
        check, started = space["ArchiveCheck"](wanted), time.perf_counter()
        for at in range(0, len(archive), FRAME):
            for piece in check.feed(archive[at : at + FRAME]):
                bytes(piece)
        check.finish()
        return time.perf_counter() - started

    ratios, before, after = [], [], []
    for _ in range(args.rounds):
        a, b = plain(), checked()
        before.append(len(archive) / a / 1e9)
        after.append(len(archive) / b / 1e9)
        ratios.append(a / b)
    print(f"archive {len(archive) / 1e6:.0f} MB in {FRAME >> 20} MiB frames, {args.rounds} rounds")
    print(f"frames copied as before: {statistics.median(before):.2f} GB/s")
    print(f"through the check:       {statistics.median(after):.2f} GB/s")
    print(f"ratio (checked / before): {statistics.median(ratios):.3f} (min {min(ratios):.3f})")


if __name__ == "__main__":
    main()
