"""Build (or reuse) the rehearsal image: Debian bookworm + Ray + the vLLM stand-in, without any registry.

Steps of a build (as root, needs ``debootstrap`` and a docker daemon):

1. ``debootstrap --variant=minbase --include=python3,... bookworm ROOTFS MIRROR``
   (MIRROR: the Debian mirror this machine's apt uses);
2. ``pip install --target ROOTFS/opt/site ray==RAY_VERSION huggingface_hub==HF_HUB_VERSION`` from the host
   (host Python must be 3.11 like bookworm's python3), unused Ray libraries pruned; ``pip install --target
   ROOTFS/opt/spark-vllm-router/ROUTER_VERSION vllm-router==ROUTER_VERSION`` (the router's own: the real one);
3. the stand-in package copied to ``/opt/site/vllm_standin``, wrappers
   ``/usr/local/bin/ray`` and ``/usr/local/bin/vllm`` written (console scripts
   from ``pip --target`` carry the host interpreter in their shebang);
4. ``tar -C ROOTFS -c . | docker import`` as ``spark-vllm-rehearsal:<hash>``,
   then ``docker save`` to ``CACHE/spark-vllm-rehearsal-<hash>.tar``.

The archive is the unit of reuse: loading the same archive into every daemon
(``load_into``) gives the same image ID everywhere, which a per-daemon
``docker import`` would not (its config carries a timestamp). ``<hash>`` covers
this file, the stand-in sources, the Ray version, the suite and the package
list, so any change of those rebuilds. Steps 1-2 are cached separately as
``CACHE/base-<key>.tar`` (key: their inputs and code), so a change of the
stand-in alone rebuilds in seconds; ``CACHE/debs`` keeps debootstrap's .debs.
Only the newest archive and base are kept.

CLI: ``python -m tests.e2e.image.build --cache-dir DIR --docker-host unix:///path.sock``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from components.config.deployments import ROUTER_VERSION
from components.plan.names import ROUTER_INSTALL_DIR as INSTALL_DIR

log = logging.getLogger("rehearsal.image")

IMAGE_REPO = "spark-vllm-rehearsal"
SUITE = "bookworm"
PYTHON_MINOR = (3, 11)  # bookworm's python3
PACKAGES = ("python3", "ca-certificates", "procps", "iproute2", "curl")
RAY_VERSION = "2.60.0"
# What vLLM brings along and the program relies on: modelSync downloads a repo id with it.
HF_HUB_VERSION = "0.36.0"
# Ray libraries that neither `ray start` nor the stand-in import (about 80 MB).
RAY_PRUNE = ("rllib", "tune", "train", "data", "serve", "llm", "jars")
# Parts of the Debian rootfs nobody reads in a test container.
ROOTFS_PRUNE = (
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
)
IMAGE_ENV = {
    "PYTHONPATH": "/opt/site",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    # The supervisor reads MemAvailable there (a link to /proc/meminfo): a test writes a GB10's figures over it
    "SPARK_VLLM_MEMINFO": "/var/lib/spark-vllm-standin/meminfo",
}
STANDIN_STATE = "/var/lib/spark-vllm-standin"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

HERE = Path(__file__).resolve().parent
STANDIN_PKG = HERE.parent / "standin" / "vllm_standin"

RAY_WRAPPER = """#!/bin/sh
# Ray CLI for a pip --target install (the generated console script points at the build host's python).
export PYTHONPATH="/opt/site${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -c 'import sys; sys.argv[0] = "ray"; from ray.scripts.scripts import main; sys.exit(main())' "$@"
"""
# NOT nvidia-smi: with no GPU it answers as nvidia-smi does without a driver (status 9), so the supervisor reads
# nothing, as in every other rehearsal test. Where a test touched $STANDIN_STATE/unified it answers as a GB10's
# does, whose memory is the system's (NVML has no framebuffer sizes there, NVML_ERROR_NOT_SUPPORTED:
# forums.developer.nvidia.com/t/358869; nvidia-smi prints "[N/A]"), and the supervisor's unified-memory rules
# read $SPARK_VLLM_MEMINFO.
NVIDIA_SMI = f"""#!/usr/bin/python3
import sys

if __import__("os").path.exists("{STANDIN_STATE}/unified"):
    query = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--query-gpu=")), None)
    if query is None:
        print("NVIDIA GB10 (stand-in: only --query-gpu answers)")
    else:
        fields = {{"index": "0", "name": "NVIDIA GB10"}}
        print(", ".join(fields.get(name.strip(), "[N/A]") for name in query.split(",")))
    sys.exit(0)
print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", file=sys.stderr)
sys.exit(9)
"""

VLLM_WRAPPER = f"""#!/bin/sh
# NOT vLLM: the rehearsal's test double for `vllm serve` (see /opt/site/vllm_standin/__init__.py).
export PYTHONPATH="/opt/site${{PYTHONPATH:+:$PYTHONPATH}}"
# A test's settings for the stand-in (its pace, a prefill's chunks: STANDIN_* lines), read at each start
if [ -r {STANDIN_STATE}/env ]; then set -a; . {STANDIN_STATE}/env; set +a; fi
exec python3 -m vllm_standin "$@"
"""


@dataclass(frozen=True)
class ImageInfo:
    ref: str  # e.g. spark-vllm-rehearsal:0123456789ab
    archive: Path  # `docker save` tarball, loadable into any daemon
    image_id: str  # sha256:..., identical on every daemon the archive is loaded into
    built: bool = False  # True when this call built the image (False: cached archive reused)
    timings: dict = field(default_factory=dict, compare=False)  # seconds per phase


# -- identity -----------------------------------------------------------------------


def standin_files() -> list[Path]:
    return sorted(p for p in STANDIN_PKG.rglob("*.py") if "__pycache__" not in p.parts)


def content_hash() -> str:
    """12 hex digits over everything that shapes the image."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for p in standin_files():
        h.update(str(p.relative_to(STANDIN_PKG)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(json.dumps([RAY_VERSION, SUITE, list(PACKAGES)]).encode())
    return h.hexdigest()[:12]


def image_ref() -> str:
    return f"{IMAGE_REPO}:{content_hash()}"


def archive_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / f"{IMAGE_REPO}-{content_hash()}.tar"


# -- helpers ---------------------------------------------------------------------------


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log.debug("run: %s", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def docker(docker_host: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return _run(["docker", "-H", docker_host, *args], **kw)


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses for the main archive (override: REHEARSAL_DEBIAN_MIRROR)."""
    env = os.environ.get("REHEARSAL_DEBIAN_MIRROR")
    if env:
        return env
    candidates: list[str] = []
    apt = Path("/etc/apt")
    for f in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        with contextlib.suppress(OSError):
            for line in f.read_text().splitlines():
                parts = line.split("#", 1)[0].split()
                if len(parts) >= 3 and parts[0] == "deb":
                    url_i = 2 if parts[1].startswith("[") else 1
                    if url_i + 1 < len(parts) and parts[url_i + 1] == SUITE:
                        candidates.append(parts[url_i])
    for f in sorted((apt / "sources.list.d").glob("*.sources")):
        with contextlib.suppress(OSError):
            for stanza in f.read_text().split("\n\n"):
                fields = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith((" ", "#")):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.split()
                if "deb" in fields.get("types", []) and SUITE in fields.get("suites", []):
                    candidates += fields.get("uris", [])
    for url in candidates:
        if url.rstrip("/").endswith("/debian"):
            return url.rstrip("/")
    return DEFAULT_MIRROR


def _mounts_under(root: Path) -> list[str]:
    root_s = str(root.resolve())
    out = []
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            mp = line.split()[1].replace("\\040", " ")
            if mp == root_s or mp.startswith(root_s + "/"):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def safe_rmtree(root: Path) -> None:
    """Remove a rootfs, first unmounting anything debootstrap left mounted inside it (never follow a mount)."""
    if not root.exists():
        return
    for mp in _mounts_under(root):
        subprocess.run(["umount", "-l", mp], check=False, capture_output=True)
    left = _mounts_under(root)
    if left:
        raise RuntimeError(f"refusing to delete {root}: still mounted: {left}")
    shutil.rmtree(root)


def archive_image_id(archive: Path) -> str:
    """The image ID recorded in a `docker save` archive (its config digest)."""
    with tarfile.open(archive) as t:
        member = t.extractfile("manifest.json")
        if member is None:
            raise RuntimeError(f"{archive}: no manifest.json")
        manifest = json.load(member)
    config = manifest[0]["Config"]  # "<hex>.json" (docker < 25) or "blobs/sha256/<hex>" (OCI layout)
    hexid = Path(config).name.removesuffix(".json")
    return f"sha256:{hexid}"


def archive_ref(archive: Path) -> str | None:
    with tarfile.open(archive) as t:
        member = t.extractfile("manifest.json")
        tags = json.load(member)[0].get("RepoTags") or [] if member else []
    return tags[0] if tags else None


def daemon_image_id(docker_host: str, ref: str) -> str | None:
    r = subprocess.run(
        ["docker", "-H", docker_host, "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True
    )
    return r.stdout.strip() if r.returncode == 0 else None


def load_into(archive: Path, docker_host: str, image_id: str | None = None) -> str:
    """Load the archive into the daemon at docker_host unless it already has the image; returns the image ID.

    Raises RuntimeError when the daemon ends up with a different ID than the archive records.
    """
    archive = Path(archive)
    expected = image_id or archive_image_id(archive)
    ref = archive_ref(archive)
    have = daemon_image_id(docker_host, ref) if ref else None
    if have != expected:
        t0 = time.monotonic()
        docker(docker_host, "load", "-i", str(archive))
        log.info("loaded %s into %s in %.1f s", archive.name, docker_host, time.monotonic() - t0)
        have = daemon_image_id(docker_host, ref or expected)
    if have != expected:
        raise RuntimeError(f"image ID on {docker_host} is {have}, archive {archive} records {expected}")
    return have


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- build -----------------------------------------------------------------------------


def check_prerequisites() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (debootstrap)")
    for tool in ("debootstrap", "docker", "tar"):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found")
    if sys.version_info[:2] != PYTHON_MINOR:
        problems.append(
            f"host Python is {sys.version_info[0]}.{sys.version_info[1]}; "
            f"pip --target needs {PYTHON_MINOR[0]}.{PYTHON_MINOR[1]} like {SUITE}'s python3"
        )
    if platform.machine() != "x86_64":
        problems.append(f"built for x86_64 only, this is {platform.machine()}")
    if problems:
        raise RuntimeError("cannot build the rehearsal image: " + "; ".join(problems))


def _debootstrap(rootfs: Path, deb_cache: Path) -> None:
    deb_cache.mkdir(parents=True, exist_ok=True)
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            f"--cache-dir={deb_cache}",
            SUITE,
            str(rootfs),
            debian_mirror(),
        ]
    )


def _pip_ray(rootfs: Path) -> None:
    site = rootfs / "opt" / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--only-binary=:all:",
            "--python-version",
            f"{PYTHON_MINOR[0]}.{PYTHON_MINOR[1]}",
            "--target",
            str(site),
            f"ray=={RAY_VERSION}",
            f"huggingface_hub=={HF_HUB_VERSION}",
        ]
    )
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with the host's shebang
    for lib in RAY_PRUNE:
        shutil.rmtree(site / "ray" / lib, ignore_errors=True)


def _pip_router(rootfs: Path) -> None:
    """vllm-router where the router container's volume is mounted (components/resources/router.py INSTALL_DIR): Docker
    fills a new volume from the image, so the keeper finds this version there and installs nothing (the
    simulated nodes reach no index)."""
    target = rootfs / INSTALL_DIR.lstrip("/") / ROUTER_VERSION
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--only-binary=:all:",
            "--python-version",
            f"{PYTHON_MINOR[0]}.{PYTHON_MINOR[1]}",
            "--target",
            str(target),
            f"vllm-router=={ROUTER_VERSION}",
        ]
    )
    shutil.rmtree(target / "bin", ignore_errors=True)


def _prune_rootfs(rootfs: Path) -> None:
    for rel in ROOTFS_PRUNE:
        d = rootfs / rel
        if d.is_dir():
            for child in d.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


def base_key() -> str:
    """Identity of the base stage (Debian + Ray): the inputs and the code of the functions that make it."""
    h = hashlib.sha256(
        json.dumps(
            [SUITE, list(PACKAGES), RAY_VERSION, HF_HUB_VERSION, ROUTER_VERSION, list(RAY_PRUNE), list(ROOTFS_PRUNE)]
        ).encode()
    )
    for fn in (_debootstrap, _pip_ray, _pip_router, _prune_rootfs):
        h.update(inspect.getsource(fn).encode())
    return h.hexdigest()[:12]


def base_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / f"base-{base_key()}.tar"


def _save_base(rootfs: Path, base_tar: Path) -> None:
    part = base_tar.with_name(f"{base_tar.name}.{os.getpid()}.part")
    _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(part), "."])
    os.replace(part, base_tar)
    for old in base_tar.parent.glob("base-*.tar"):  # keep one base: disk use
        if old != base_tar:
            old.unlink(missing_ok=True)


def _stage_files(stage: Path) -> list[str]:
    """Write the image's own files (stand-in, wrappers) under stage; returns their paths relative to /."""
    dest = stage / "opt" / "site" / "vllm_standin"
    for p in standin_files():
        target = dest / p.relative_to(STANDIN_PKG)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
        target.chmod(0o644)
    bindir = stage / "usr" / "local" / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    for name, text in (("ray", RAY_WRAPPER), ("vllm", VLLM_WRAPPER), ("nvidia-smi", NVIDIA_SMI)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    state = stage / STANDIN_STATE.lstrip("/")
    state.mkdir(parents=True, exist_ok=True)
    (state / "meminfo").symlink_to("/proc/meminfo")
    return [
        "./opt/site/vllm_standin",
        "./usr/local/bin/ray",
        "./usr/local/bin/vllm",
        "./usr/local/bin/nvidia-smi",
        "." + STANDIN_STATE,
    ]


def _image_tar(base_tar: Path, work: Path) -> Path:
    """The base rootfs tar with the stand-in and wrappers appended (no unpacking of the base)."""
    stage = work / "stage"
    rels = _stage_files(stage)
    out = work / "image.tar"
    shutil.copyfile(base_tar, out)
    _run(["tar", "--numeric-owner", "--owner=0", "--group=0", "-rf", str(out), "-C", str(stage), *rels])
    return out


def _import(image_tar: Path, docker_host: str, ref: str) -> None:
    changes = []
    for k, v in IMAGE_ENV.items():
        changes += ["-c", f"ENV {k}={v}"]
    changes += ["-c", 'CMD ["/bin/bash"]']
    docker(docker_host, "import", *changes, str(image_tar), ref)


def _build_base(cache_dir: Path, base_tar: Path, phase) -> None:
    work = cache_dir / f"base-{base_key()}-{os.getpid()}"
    rootfs = work / "rootfs"
    try:
        work.mkdir(parents=True)
        phase("debootstrap", _debootstrap, rootfs, cache_dir / "debs")
        phase("pip install ray", _pip_ray, rootfs)
        phase("pip install vllm-router", _pip_router, rootfs)
        phase("prune + save base", lambda: (_prune_rootfs(rootfs), _save_base(rootfs, base_tar)))
    finally:
        phase("remove rootfs", safe_rmtree, work)


def build_archive(cache_dir: Path, docker_host: str) -> dict:
    """Build the image on docker_host and save it to archive_path(cache_dir); returns timings."""
    check_prerequisites()
    cache_dir = Path(cache_dir).resolve()
    ref, archive = image_ref(), archive_path(cache_dir)
    timings: dict[str, float] = {}

    def phase(name, fn, *a):
        t0 = time.monotonic()
        log.info("%s ...", name)
        fn(*a)
        timings[name] = round(time.monotonic() - t0, 1)
        log.info("%s took %.1f s", name, timings[name])

    base_tar = base_path(cache_dir)
    with _locked(base_tar.with_suffix(".lock")):
        if not base_tar.exists():
            _build_base(cache_dir, base_tar, phase)
    work = cache_dir / f"build-{content_hash()}-{os.getpid()}"
    try:
        work.mkdir(parents=True)
        box = {}
        phase("assemble", lambda: box.setdefault("tar", _image_tar(base_tar, work)))
        phase("docker import", _import, box["tar"], docker_host, ref)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # plain files only: nothing is mounted here
    tmp = archive.with_suffix(".tar.part")
    phase("docker save", lambda: docker(docker_host, "save", "-o", str(tmp), ref))
    tmp.chmod(0o644)  # docker save -o writes 0600
    os.replace(tmp, archive)
    for old in cache_dir.glob(f"{IMAGE_REPO}-*.tar"):  # keep the current archive only: disk use
        if old != archive:
            old.unlink(missing_ok=True)
    return timings


def ensure_image(cache_dir: Path, docker_host: str) -> ImageInfo:
    """The rehearsal image on docker_host, built once per content hash and cached as a `docker save` archive.

    Concurrent callers (threads or processes) sharing cache_dir build at most once.
    """
    cache_dir = Path(cache_dir).resolve()
    ref, archive = image_ref(), archive_path(cache_dir)
    t_start = time.monotonic()
    with _locked(archive.with_suffix(".lock")):
        built = False
        timings: dict[str, float] = {}
        if not archive.exists():
            timings.update(build_archive(cache_dir, docker_host))
            built = True
        t0 = time.monotonic()
        image_id = archive_image_id(archive)
        timings["read archive id"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        load_into(archive, docker_host, image_id)
        timings["load/verify"] = round(time.monotonic() - t0, 1)
    timings["total"] = round(time.monotonic() - t_start, 1)
    return ImageInfo(ref=ref, archive=archive, image_id=image_id, built=built, timings=timings)


def registry_image_id(registry: str, ref: str) -> str:
    """The image id (the config digest of its manifest) the registry at host:port serves as `repo:tag`,
    or "" when it has no such tag."""
    repo, tag = ref.rsplit(":", 1)
    request = urllib.request.Request(
        f"http://{registry}/v2/{repo}/manifests/{tag}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read()).get("config", {}).get("digest", "")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return ""
        raise


def registry_has(registry: str, ref: str, image_id: str) -> bool:
    """Whether the registry serves `repo:tag` as exactly `image_id`. The registry's storage outlives
    the archive: an archive built again (another build of the same sources carries another import
    time, so another id) must be pushed again, or nodes would pull the older build."""
    return bool(image_id) and registry_image_id(registry, ref) == image_id


def publish(cache_dir: Path, registry: str, docker_host: str) -> ImageInfo:
    """The rehearsal image in the registry at `registry` (host:port), pushed once through the daemon at
    `docker_host`, which is left without the image (nodes pull it as real ones do), and the edge's HAProxy
    image beside it (haproxy_ref). Returns the registry reference; its image id equals the archive's."""
    info = _publish_base(cache_dir, registry, docker_host)
    publish_haproxy(cache_dir, docker_host, info.ref)
    return info


def _publish_base(cache_dir: Path, registry: str, docker_host: str) -> ImageInfo:
    cache_dir = Path(cache_dir).resolve()
    local = image_ref()
    remote = f"{registry}/{local}"
    t_start = time.monotonic()
    with _locked(cache_dir / "registry.lock"):
        if registry_has(registry, local, _archive_id(cache_dir)):
            return ImageInfo(ref=remote, archive=archive_path(cache_dir), image_id=_archive_id(cache_dir), built=False)
        info = ensure_image(cache_dir, docker_host)
        docker(docker_host, "tag", info.ref, remote)
        docker(docker_host, "push", remote)
        docker(docker_host, "rmi", remote, info.ref)
    timings = {**info.timings, "published": round(time.monotonic() - t_start, 1)}
    return ImageInfo(ref=remote, archive=info.archive, image_id=info.image_id, built=info.built, timings=timings)


PROMETHEUS_PACKAGE = "prometheus"  # Debian's: the rehearsal's real Prometheus (one binary, linked to libc only)
PROMETHEUS_REPO = "spark-vllm-rehearsal-prometheus"
# Debian's HAProxy (the edge, components/plan/edge.py) and the libraries it links that the rehearsal image and a
# bookworm host lack: unpacked, not installed (an install would start a haproxy service on the host).
HAPROXY_PACKAGES = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")
HAPROXY_REPO = "spark-vllm-rehearsal-haproxy"


def debian_root(cache_dir: Path, packages: tuple[str, ...]) -> Path:
    """`packages` (`apt-get download`, this machine's apt sources) unpacked into one tree, kept in
    CACHE/debian-<first package>; the tree's `.complete` says it is whole."""
    root = Path(cache_dir) / f"debian-{packages[0]}"
    if (root / ".complete").exists():
        return root
    with _locked(Path(cache_dir) / f"debian-{packages[0]}.lock"):
        if (root / ".complete").exists():
            return root
        work = root.with_name(root.name + ".work")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        (work / "debs").mkdir(parents=True)
        try:
            _run(["apt-get", "download", *packages], cwd=work / "debs")
        except RuntimeError:  # no package lists yet (a machine whose packages were all there): read them once
            _run(["apt-get", "update", "-qq"])
            _run(["apt-get", "download", *packages], cwd=work / "debs")
        for deb in sorted((work / "debs").glob("*.deb")):
            _run(["dpkg-deb", "-x", str(deb), str(work / "root")])
        (work / "root" / ".complete").write_text(" ".join(packages) + "\n")
        (work / "root").rename(root)
        shutil.rmtree(work, ignore_errors=True)
    return root


def haproxy_command(cache_dir: Path) -> list[str]:
    """argv that runs Debian's haproxy from its unpacked tree on this (bookworm) machine; SPARK_VLLM_HAPROXY_ROOT
    names a tree unpacked elsewhere (the GPU lane's machine has no apt sources: the tree travels with it)."""
    given = os.environ.get("SPARK_VLLM_HAPROXY_ROOT")
    root = Path(given) if given else debian_root(cache_dir, HAPROXY_PACKAGES)
    libs = ":".join(str(root / sub) for sub in ("usr/lib/x86_64-linux-gnu", "usr/lib"))
    return ["env", f"LD_LIBRARY_PATH={libs}", str(root / "usr" / "sbin" / "haproxy")]


def prometheus_binary(cache_dir: Path) -> Path:
    """/usr/bin/prometheus of Debian's package (`apt-get download`, this machine's apt sources)."""
    return debian_root(cache_dir, (PROMETHEUS_PACKAGE,)) / "usr" / "bin" / "prometheus"


def _derived_ref(registry: str, base_ref: str, repo: str, tree: Path, dockerfile: str) -> str:
    """The registry reference of an image FROM `base_ref` with `tree` as its build context: tagged by the base,
    the tree's files and `dockerfile`, so a change of any rebuilds it."""
    digest = hashlib.sha256(base_ref.encode() + b"\0" + dockerfile.encode())
    for path in sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return f"{registry}/{repo}:{digest.hexdigest()[:12]}"


def _publish_derived(cache_dir: Path, docker_host: str, remote: str, base_ref: str, tree: Path, dockerfile: str) -> str:
    """`remote` (a _derived_ref) in its registry, built through the daemon at `docker_host`, which pulls the
    base from the registry and is left without either image."""
    cache_dir = Path(cache_dir).resolve()
    registry, name = remote.split("/", 1)
    with _locked(cache_dir / "registry.lock"):
        if registry_image_id(registry, name):
            return remote
        context = cache_dir / f"{name.split(':')[0]}-context"
        shutil.rmtree(context, ignore_errors=True)
        shutil.copytree(tree, context, symlinks=True)
        (context / "Dockerfile").write_text(f"FROM {base_ref}\n{dockerfile}")
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        docker(docker_host, "build", "-q", "-t", remote, str(context), env=env)
        docker(docker_host, "push", remote)
        with contextlib.suppress(RuntimeError):  # the daemon is left as publish() leaves it: without images
            docker(docker_host, "rmi", remote, base_ref)
        shutil.rmtree(context, ignore_errors=True)
    return remote


PROMETHEUS_DOCKERFILE = "COPY prometheus /bin/prometheus\nRUN mkdir -p /prometheus\n"
# Laid out as the official `haproxy` image is where the edge relies on it: the binary on PATH
# (/usr/local/sbin/haproxy), bash, and the user `haproxy` (uid 99) it runs as.
HAPROXY_DOCKERFILE = (
    "COPY . /usr/\n"
    "RUN ldconfig && ln -s /usr/sbin/haproxy /usr/local/sbin/haproxy"
    " && groupadd -g 99 haproxy && useradd -u 99 -g 99 -d /var/lib/haproxy -s /usr/sbin/nologin haproxy\n"
    "USER haproxy\n"
)


def publish_prometheus(cache_dir: Path, registry: str, docker_host: str, base: ImageInfo) -> str:
    """A Prometheus image in the registry: the rehearsal image with Debian's prometheus as /bin/prometheus,
    where prom/prometheus has it. Returns its registry reference."""
    tree = debian_root(cache_dir, (PROMETHEUS_PACKAGE,)) / "usr" / "bin"
    remote = _derived_ref(registry, base.ref, PROMETHEUS_REPO, tree, PROMETHEUS_DOCKERFILE)
    return _publish_derived(cache_dir, docker_host, remote, base.ref, tree, PROMETHEUS_DOCKERFILE)


def haproxy_ref(cache_dir: Path, base_ref: str) -> str:
    """The edge's image for the rehearsal image `base_ref` (registry/name:tag): what publish() put beside it."""
    tree = debian_root(cache_dir, HAPROXY_PACKAGES) / "usr"
    return _derived_ref(base_ref.split("/", 1)[0], base_ref, HAPROXY_REPO, tree, HAPROXY_DOCKERFILE)


def publish_haproxy(cache_dir: Path, docker_host: str, base_ref: str) -> str:
    """The edge's HAProxy image in the registry of `base_ref`. Returns its registry reference."""
    tree = debian_root(cache_dir, HAPROXY_PACKAGES) / "usr"
    remote = haproxy_ref(cache_dir, base_ref)
    return _publish_derived(cache_dir, docker_host, remote, base_ref, tree, HAPROXY_DOCKERFILE)


PLAYS_DOCKERFILE = "COPY PLAYS /opt/site/vllm_standin/PLAYS\n"
PLAYS_REPO = "spark-vllm-rehearsal-plays"


def publish_played(cache_dir: Path, docker_host: str, base_ref: str, version: str) -> str:
    """The rehearsal image with its stand-in playing vLLM `version` (vllm_standin/versions.py reads the file PLAYS
    beside it), in the registry of `base_ref`: what `vllm --version`, the image probe and /version say, and what the
    stand-in does (its flags, routes and log lines). Returns its registry reference."""
    tree = Path(cache_dir) / f"plays-{version}"
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "PLAYS").write_text(version + "\n")
    remote = _derived_ref(base_ref.split("/", 1)[0], base_ref, PLAYS_REPO, tree, PLAYS_DOCKERFILE)
    return _publish_derived(cache_dir, docker_host, remote, base_ref, tree, PLAYS_DOCKERFILE)


TORCH_REPO = "spark-vllm-rehearsal-torch"
TORCH_DOCKERFILE = "COPY site /opt/site\n"


def publish_with_torch(cache_dir: Path, docker_host: str, base_ref: str, cuda: str, arch: str) -> str:
    """The rehearsal image with a torch that says what a real one's files and library say, and nothing else: its
    version and dist-info as pip leaves them, torch/version.py's `cuda`, `torch._C._cuda_getArchFlags()` (`arch`,
    space-separated, as torch 2.11.0+cu130 gives "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"). What the image probe
    reads for the host check (components/plan/host.py); nothing in the stand-in imports torch. Returns its
    registry reference."""
    tree = Path(cache_dir) / f"torch-{cuda}-{arch.replace(' ', '-')}"
    site = tree / "site"
    (site / "torch").mkdir(parents=True, exist_ok=True)
    (site / "torch-2.11.0.dist-info").mkdir(exist_ok=True)
    (site / "torch-2.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    (site / "torch" / "version.py").write_text(f"__version__ = '2.11.0'\ncuda: Optional[str] = {cuda!r}\n")
    (site / "torch" / "__init__.py").write_text(
        f"class _C:\n    @staticmethod\n    def _cuda_getArchFlags():\n        return {arch!r}\n"
    )
    remote = _derived_ref(base_ref.split("/", 1)[0], base_ref, TORCH_REPO, tree, TORCH_DOCKERFILE)
    return _publish_derived(cache_dir, docker_host, remote, base_ref, tree, TORCH_DOCKERFILE)


def _archive_id(cache_dir: Path) -> str:
    archive = archive_path(cache_dir)
    return archive_image_id(archive) if archive.exists() else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.e2e.image.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", required=True, type=Path, help="where archives (and the .deb cache) live")
    p.add_argument(
        "--docker-host", required=True, help="daemon to build on / load into, e.g. unix:///run/x/docker.sock"
    )
    p.add_argument(
        "--load-into",
        action="append",
        default=[],
        metavar="DOCKER_HOST",
        help="also load the archive into these daemons (repeatable)",
    )
    p.add_argument("--print-ref", action="store_true", help="print the image ref for the current sources and exit")
    a = p.parse_args(argv)
    if a.print_ref:
        print(image_ref())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    info = ensure_image(a.cache_dir, a.docker_host)
    print(f"ref:      {info.ref}")
    print(f"image id: {info.image_id}")
    print(f"archive:  {info.archive} ({info.archive.stat().st_size / 2**20:.0f} MiB)")
    print(f"built:    {info.built}")
    for k, v in info.timings.items():
        print(f"  {k:16} {v:7.1f} s")
    for host in a.load_into:
        t0 = time.monotonic()
        image_id = load_into(info.archive, host, info.image_id)
        print(f"loaded into {host}: {image_id} in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
