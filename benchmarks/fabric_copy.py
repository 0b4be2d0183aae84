"""Copies over the simulated fabric: components/scripts/node_fabric_copy.py against a raw stream.

    sudo venv/bin/python -m benchmarks.fabric_copy [--model-gib 2] [--pairs 3] [--decide-gib 100]

Two simulated nodes (tests/e2e/nodes.py: network namespaces joined by the fabric bridge). Each
measure runs the copy and its yardstick in turn, pair by pair (so a drift in this shared machine's
speed hits both), and reports the median of the per-pair throughput ratios:

* model: a directory of random files (`--model-gib`), node-1's depot to node-2's client, versus
  `tar -c | socat` on node-1 to `socat | tar -x` on node-2 — the same bytes over the same link, with
  no authentication, no integrity check, no progress. Both end with `sync` (the copy fdatasyncs each
  file; tar leaves it to the page cache), and both write into an emptied directory: once on disk
  (what a node does; this machine's disk sets the pace), once in memory (tmpfs: what is left is
  the link and the two programs, so the copy's own cost shows).
* image: the rehearsal image (Debian + Ray, about 300 MiB), from node-1's dockerd to node-2's,
  versus `docker save | socat` to `socat | docker load`; the image is removed from node-2 between runs.
* decide: a model of `--decide-gib` GB (sparse files: metadata is what is read) already on node-2:
  the time the client takes to find there is nothing to copy (handshake, the depot's manifest, every
  file's lstat), as it reports it, and the whole client process.

Targets: copy throughput at least 0.8 of the raw stream; deciding "nothing to copy" for 100 GB in
under 1 s. Numbers are printed, nothing is asserted. Needs root and socat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components.plan.programs import script_program
from tests.e2e import nodes as simnodes
from tests.e2e.image.build import ensure_image, load_into
from tests.e2e.rehearsal import CACHE_DIR

TOKEN = "be" * 32
PORT, RAW_PORT = 29650, 29651


def depot(node, port: int, *, model_dir: Path | None = None, bind: Path | None = None, image_id: str | None = None):
    """fabric_copy.py serving on node's fabric address (in its network namespace; with `bind`, in a
    mount namespace where `bind` shows at `model_dir`, as the source node's own copy would)."""
    params = {"role": "serve", "node": node.name, "source": node.name, "address": node.fabric_ip, "port": port,
              "model_dir": str(model_dir) if model_dir else None, "image_id": image_id}  # fmt: skip
    argv = [sys.executable, "-u", "-c", script_program("node_fabric_copy.py", params)]
    if bind:
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(bind), str(model_dir),
                *argv]  # fmt: skip
    env = {**os.environ, "SPARK_VLLM_COPY_TOKEN": TOKEN, "DOCKER_HOST": node.docker_host}
    process = subprocess.Popen(["nsenter", f"--net={node.netns_path}", *argv], env=env, stdout=subprocess.DEVNULL)
    time.sleep(1.0)
    if process.poll() is not None:
        raise RuntimeError("the depot did not start")
    return process


def client(node, source, port: int, role: str, **params) -> tuple[float, dict]:
    params = {"role": role, "node": node.name, "source": source.name, "address": source.fabric_ip, "port": port,
              "token": TOKEN, "progress_seconds": 3600, **params}  # fmt: skip
    env = {**os.environ, "DOCKER_HOST": node.docker_host}
    started = time.monotonic()
    result = subprocess.run(
        ["nsenter", f"--net={node.netns_path}", sys.executable, "-"],
        input=script_program("node_fabric_copy.py", params),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise RuntimeError(f"the copy failed: {result.stdout}{result.stderr}")
    return seconds, json.loads(result.stdout.splitlines()[-1])


def raw_stream(source, target, send: str, receive: str) -> float:
    """`send | socat` on the source node, `socat | receive` on the target: seconds of the receiving end."""
    listen = f"TCP-LISTEN:{RAW_PORT},bind={source.fabric_ip},reuseaddr"
    sender = subprocess.Popen(
        ["nsenter", f"--net={source.netns_path}", "sh", "-c", f"{send} | socat -u -b 4194304 - {listen}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    started = time.monotonic()
    connect = f"TCP:{source.fabric_ip}:{RAW_PORT},retry=100,interval=0.05"
    subprocess.run(
        ["nsenter", f"--net={target.netns_path}", "sh", "-c", f"socat -u -b 4194304 {connect} - | {receive}"],
        check=True,
    )
    seconds = time.monotonic() - started
    sender.wait(timeout=60)
    return seconds


def synced(seconds_started: float) -> float:
    subprocess.run(["sync"], check=True)
    return time.monotonic() - seconds_started


def empty(directory: Path) -> None:
    """Empty the directory, keeping the directory itself: the depot's view of the source is bound
    onto it in another mount namespace, and removing a mount point detaches such a mount."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    subprocess.run(["sync"], check=True)


def make_model(root: Path, gib: float) -> int:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    shards, total = 4, int(gib * (1 << 30))
    for index in range(shards):
        path = root / f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        if path.exists() and path.stat().st_size == total // shards:
            continue
        with open(path, "wb") as handle:
            left = total // shards
            while left:
                chunk = min(left, 1 << 24)
                handle.write(os.urandom(chunk))
                left -= chunk
    return sum(p.stat().st_size for p in root.iterdir())


def paired(pairs: int, ours, raw) -> list[tuple[float, float]]:
    results = []
    for _ in range(pairs):
        results.append((ours(), raw()))
    return results


def report(title: str, size: int, runs: list[tuple[float, float]]) -> float:
    ratios = [raw / ours for ours, raw in runs]  # throughput ours / raw
    ours = statistics.median(o for o, _ in runs)
    raw = statistics.median(r for _, r in runs)
    ratio = statistics.median(ratios)
    print(f"\n{title}: {size / 1e9:.2f} GB, {len(runs)} pairs")
    print(f"  fabric copy   median {ours:6.2f} s   {size / ours / 1e9:6.2f} GB/s")
    print(f"  raw stream    median {raw:6.2f} s   {size / raw / 1e9:6.2f} GB/s")
    verdict = "PASS" if ratio >= 0.8 else "FAIL"
    per_pair = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"  ratio (copy / raw, median of pairs): {ratio:.2f}   per pair: {per_pair}   target >= 0.8: {verdict}")
    return ratio


def measure_model(cluster, work: Path, gib: float, pairs: int, target_root: Path, where: str) -> None:
    head, worker = cluster.nodes
    source, target = work / "model-source", target_root / "models" / "bench-model"
    size = make_model(source, gib)
    empty(target)
    server = depot(head, PORT, model_dir=target, bind=source)
    try:

        def ours() -> float:
            empty(target)
            started = time.monotonic()
            _, summary = client(worker, head, PORT, "model", model_dir=str(target))
            seconds = synced(started)
            if summary["copied_bytes"] != size:
                raise RuntimeError(f"copied {summary['copied_bytes']} of {size} bytes")
            return seconds

        def raw() -> float:
            empty(target)
            started = time.monotonic()
            raw_stream(head, worker, f"tar -b 2048 -C {source} -cf - .", f"tar -b 2048 -C {target} -xf -")
            return synced(started)

        report(f"model directory, written to {where}", size, paired(pairs, ours, raw))
    finally:
        server.kill()
        shutil.rmtree(target_root / "models", ignore_errors=True)


def measure_image(cluster, pairs: int) -> None:
    head, worker = cluster.nodes
    info = ensure_image(CACHE_DIR, head.docker_host)
    load_into(info.archive, head.docker_host, info.image_id)
    size = info.archive.stat().st_size
    server = depot(head, PORT + 2, image_id=info.image_id)

    def remove() -> None:
        cluster.docker(worker, "image", "rm", "-f", info.image_id, check=False)
        cluster.docker(worker, "image", "prune", "-f", check=False)

    try:

        def ours() -> float:
            remove()
            seconds, summary = client(worker, head, PORT + 2, "image", image_id=info.image_id, reference="")
            if summary["copied_bytes"] == 0:
                raise RuntimeError("the image was not copied")
            return seconds

        def raw() -> float:
            remove()
            return raw_stream(
                head,
                worker,
                f"docker -H {head.docker_host} save {info.image_id}",
                f"docker -H {worker.docker_host} load -q",
            )

        report("image (docker save → docker load)", size, paired(pairs, ours, raw))
    finally:
        server.kill()


def measure_decide(cluster, work: Path, gib: int, runs: int) -> None:
    head, worker = cluster.nodes
    source, target = work / "big-source", work / "models" / "big-model"
    source.mkdir(parents=True, exist_ok=True)
    files = 40
    for index in range(files):  # sparse: apparent size only
        with open(source / f"model-{index + 1:05d}-of-{files:05d}.safetensors", "wb") as handle:
            handle.truncate(gib * 10**9 // files)
    (source / "config.json").write_text("{}")
    empty(target)
    server = depot(head, PORT + 4, model_dir=target, bind=source)
    try:
        client(worker, head, PORT + 4, "model", model_dir=str(target))  # the first copy (holes only)
        results = [client(worker, head, PORT + 4, "model", model_dir=str(target)) for _ in range(runs)]
    finally:
        server.kill()
    assert all(summary["copied_bytes"] == 0 for _, summary in results)
    decided = statistics.median(summary["decided_seconds"] for _, summary in results)
    whole = statistics.median(seconds for seconds, _ in results)
    print(f"\ndecide 'nothing to copy': {gib} GB in {files + 1} files, {runs} runs")
    print(f"  decided (handshake, manifest, lstat of every file), median: {decided:.3f} s   target < 1 s: "
          f"{'PASS' if decided < 1 else 'FAIL'}")  # fmt: skip
    print(f"  the whole client process (Python start included), median: {whole:.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-gib", type=float, default=2.0)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--decide-gib", type=int, default=100)
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("socat") is None:
        print("needs root and socat (scripts/setup.sh installs it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spark-vllm-copy-bench-", dir="/var/tmp") as work:
        work = Path(work)
        with simnodes.simulated_nodes(2, work / "nodes") as cluster:
            print(f"fabric: {cluster.nodes[0].fabric_ip} → {cluster.nodes[1].fabric_ip} (veth over a bridge)")
            measure_model(cluster, work, args.model_gib, args.pairs, work, "disk")
            with tempfile.TemporaryDirectory(prefix="spark-vllm-copy-bench-", dir="/dev/shm") as memory:
                measure_model(cluster, work, args.model_gib, args.pairs, Path(memory), "memory (tmpfs)")
            measure_image(cluster, args.pairs)
            measure_decide(cluster, work, args.decide_gib, runs=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
