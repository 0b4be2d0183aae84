"""Gather the GPU lane's wheels and pack them for the GPU machine: `venv/bin/python -m tests.gpu.pack`.

The GPU machine reaches no registry and takes at most ~64 MiB a call (the working tree included), so the
wheels of tests/gpu/requirements.txt (vLLM 0.25.0, Ray 2.60.0 and what the machine lacks, pinned) are
downloaded here once, --no-deps, for CPython 3.12 on manylinux x86_64, into a cache keyed by the pins,
put in one uncompressed tar (wheels are zip files already: compressing them again saves under 2 %)
with the edge's haproxy (Debian's, unpacked here from `apt-get download`: the GPU machine has no apt sources, and
the router phase runs the edge in front of vllm-router; tests/gpu/device.sh points SPARK_VLLM_HAPROXY_ROOT at it),
and split into parts of PART_BYTES under `.gpu/parts/` (ignored by git). One part travels a call:
tests/gpu/device.sh `receive N` puts it aside there, `run …` joins them and installs once.

Prints what it made: the parts, their sizes and the sha256 of the whole, which device.sh checks.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.e2e.cache import CACHE_DIR
from tests.e2e.image.build import HAPROXY_PACKAGES, debian_root

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
CACHE = Path(os.environ.get("SPARK_VLLM_GPU_CACHE", "/var/tmp/spark-vllm-gpu"))
PARTS = ROOT / ".gpu" / "parts"
PART_BYTES = 56 * 1024 * 1024  # with the working tree (3.9 MiB on 2026-12-05), under the 64 MiB a call carries
PLATFORMS = [
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
]  # fmt: skip


def pins(text: str) -> list[str]:
    """`name==version` lines of a requirements file (comments and blank lines skipped); each must be pinned."""
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line or any(c in line for c in "<>;~!"):
            raise ValueError(f"not an exact pin: {line!r} (the lane installs with --no-deps: pin name==version)")
        found.append(line)
    return found


def split(data_path: Path, out_dir: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """`data_path` cut into `out_dir/part-NN` files of at most `part_bytes`; old parts removed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*"):
        old.unlink()
    made = []
    with open(data_path, "rb") as source:
        while chunk := source.read(part_bytes):
            part = out_dir / f"part-{len(made):02d}"
            part.write_bytes(chunk)
            made.append(part)
    return made


def edge_tree() -> Path:
    """Debian's haproxy and its libraries, unpacked (the rehearsal's cache): what the lane's edge runs there."""
    return debian_root(CACHE_DIR, HAPROXY_PACKAGES)


def download(requirements: list[str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *platform_args, "-d", str(into), *requirements]  # fmt: skip
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part-mib", type=int, default=PART_BYTES // (1024 * 1024))
    parser.add_argument(
        "--without",
        default="",
        help="distributions left out, comma-separated (e.g. ray,vllm-router for a lane of mp phases without the "
        "router: two parts fewer to send)",
    )
    args = parser.parse_args(argv)
    requirements = pins(REQUIREMENTS.read_text())
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    wheels = CACHE / f"wheels-{key}"
    if len(list(wheels.glob("*.whl"))) != len(requirements):
        download(requirements, wheels)
    found = sorted(wheels.glob("*.whl"))
    if len(found) != len(requirements):
        print(f"pack: {len(found)} wheels for {len(requirements)} pins in {wheels}", file=sys.stderr)
        return 1
    left_out = {name.strip().lower().replace("-", "_") for name in args.without.split(",") if name.strip()}
    if left_out:
        found = [wheel for wheel in found if wheel.name.split("-", 1)[0].lower() not in left_out]
        key += "-without-" + "-".join(sorted(left_out))
    haproxy = edge_tree()
    key += "-" + hashlib.sha256((haproxy / ".complete").read_bytes()).hexdigest()[:8]  # the packages it holds
    archive = CACHE / f"wheels-{key}.tar"
    if not archive.exists():
        partial = archive.with_suffix(".tar.partial")
        with tarfile.open(partial, "w") as tar:
            for wheel in found:
                tar.add(wheel, arcname=f"wheels/{wheel.name}")
            tar.add(haproxy, arcname="haproxy")
        partial.rename(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    made = split(archive, PARTS, args.part_mib * 1024 * 1024)
    (PARTS / "SHA256").write_text(f"{digest}  wheels.tar\n")
    print(f"pack: {len(found)} wheels, {archive.stat().st_size / 2**20:.0f} MiB in {len(made)} parts of at most "
          f"{args.part_mib} MiB under {PARTS.relative_to(ROOT)} (sha256 {digest[:16]}…)")  # fmt: skip
    for part in made:
        print(f"  {part.name}  {part.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
