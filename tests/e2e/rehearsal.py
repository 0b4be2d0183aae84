"""The rehearsal: the real program applied to simulated nodes on this machine, end to end.

    sudo ./rehearse                  # 2 nodes: deploy, one chat request, destroy; time per stage
    sudo ./rehearse --nodes 3 --pp   # 3 nodes, pipeline parallel
    sudo ./rehearse --keep           # leave the cluster up to explore …
    sudo ./rehearse teardown         # … and remove it afterwards

Each node is a network namespace with its own sshd and dockerd (tests/e2e/nodes.py), the image
is built locally with a real Ray and a stand-in for vLLM (tests/e2e/image, tests/e2e/standin), and
the program runs under Pulumi's mocks with every resource carried out for real
(tests/e2e/engine.py). No GPU, no weights, no registry, no Pulumi engine: it proves the generated
commands, containers and waits work together; `pulumi up` on real hosts is what users run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tests.e2e import nodes as simnodes
from tests.e2e.engine import Deployment, Operation
from tests.e2e.image.build import ensure_image

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKDIR = ROOT / ".rehearsal"
# The image archive is kept between runs, keyed by the hash of what goes into it.
CACHE_DIR = Path(os.environ.get("SPARK_VLLM_REHEARSAL_CACHE", "/var/tmp/spark-vllm-rehearsal"))
MODEL_CONFIG = {"architectures": ["StandinForCausalLM"], "model_type": "standin", "max_position_embeddings": 8192}


def make_model(workdir: Path, name: str = "tiny-chat") -> Path:
    """A model directory like a real one (config.json, tokenizer files), minus the weights."""
    model = workdir / "models" / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    return model


def sandbox_ulimits() -> dict[str, int]:
    """The production defaults, capped at what this machine's hard limits allow."""
    import resource

    def cap(limit: int, wanted: int) -> int:
        hard = resource.getrlimit(limit)[1]
        if hard == resource.RLIM_INFINITY:
            return wanted
        return hard if wanted == -1 else min(wanted, hard)

    return {
        "memlock": cap(resource.RLIMIT_MEMLOCK, -1),
        "stack": cap(resource.RLIMIT_STACK, 67108864),
        "nofile": cap(resource.RLIMIT_NOFILE, 1048576),
    }


def rehearsal_config(
    cluster: simnodes.SimCluster,
    image_ref: str,
    model: Path,
    *,
    pipeline_parallel: bool = False,
    **overrides: Any,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Stack config and secrets for the simulated nodes: management and fabric addresses differ, as on Sparks."""
    count = len(cluster.nodes)
    config: dict[str, Any] = {
        "nodes": [
            {
                "name": node.name,
                "host": node.mgmt_ip,
                "user": "root",
                "fabricAddress": node.fabric_ip,
                "fabricInterface": node.fabric_interface,
                "hostKey": node.host_key,
            }
            for node in cluster.nodes
        ],
        "image": image_ref,
        "model": str(model),
        "tensorParallelSize": 1 if pipeline_parallel else count,
        "pipelineParallelSize": count if pipeline_parallel else 1,
        "maxModelLen": 4096,
        # CPU-only hosts (Ray still declares --num-gpus); limits within this sandbox's hard limits,
        # which root cannot raise here (no CAP_SYS_RESOURCE).
        "container": {"gpus": False, "shmSizeMb": 256, "ulimits": sandbox_ulimits()},
        "ray": {"dashboard": False, "joinTimeoutSeconds": 120},
        "vllm": {"port": 8000, "readyTimeoutSeconds": 180},
        "security": {"requireHostKeys": True},
    }
    config.update(overrides)
    return config, {
        "apiKey": "sk-rehearsal-" + secrets.token_hex(12),
        "hfToken": "hf_rehearsal_" + secrets.token_hex(12),
        "sshPrivateKey": cluster.client_key_private,
    }


@dataclass
class StageClock:
    """Wall-clock windows of the engine's operations, grouped into the stages users wait for."""

    started: float
    marks: list[tuple[Operation, float]]

    @classmethod
    def start(cls) -> StageClock:
        return cls(time.monotonic(), [])

    def record(self, operation: Operation) -> None:
        self.marks.append((operation, time.monotonic()))

    def finished(self, predicate) -> Optional[float]:
        ends = [end for op, end in self.marks if predicate(op)]
        return max(ends) if ends else None

    def stages(self) -> dict[str, Optional[float]]:
        """Seconds from the end of one stage to the end of the next: they add up to the deploy time."""
        ends = {
            "image on every node": self.finished(lambda op: op.typ.endswith("RemoteImage")),
            "node checks (preflight, model fingerprint)": self.finished(
                lambda op: op.name.endswith(("-preflight", "-model-fingerprint", "-gpu-check"))
            ),
            "Ray formation (containers → all nodes joined)": self.finished(
                lambda op: op.name.endswith("-cluster-ready")
            ),
            "vLLM start → ready": self.finished(lambda op: op.name.endswith("-ready") and "cluster" not in op.name),
            "smoke test": self.finished(lambda op: op.name.endswith("-smoke")),
        }
        result, previous = {}, self.started
        for stage, end in ends.items():
            result[stage] = None if end is None else end - previous
            previous = end if end is not None else previous
        return result


def request(url: str, api_key: Optional[str] = None, body: Optional[dict] = None, timeout: float = 30) -> tuple:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None


def chat(endpoint: str, api_key: str, model: str) -> dict:
    status, answer = request(
        f"{endpoint}/chat/completions",
        api_key,
        {"model": model, "messages": [{"role": "user", "content": "hello from the rehearsal"}], "max_tokens": 16},
    )
    if status != 200:
        raise RuntimeError(f"chat completion failed: HTTP {status}")
    return answer


def _print_stages(title: str, clock: StageClock) -> None:
    print(f"\n{title}")
    for stage, seconds in clock.stages().items():
        print(f"  {stage:<48} {'-' if seconds is None else f'{seconds:6.1f} s'}")
    print(f"  {'total':<48} {time.monotonic() - clock.started:6.1f} s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rehearse", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("action", nargs="?", choices=["run", "teardown"], default="run")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--pp", action="store_true", help="pipeline parallel across nodes instead of tensor parallel")
    parser.add_argument("--keep", action="store_true", help="leave the cluster up; `rehearse teardown` removes it")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)

    if args.action == "teardown":
        return teardown(args.workdir)
    problem = simnodes.skip_reason()
    if problem:
        print(f"rehearse: cannot simulate nodes here: {problem}", file=sys.stderr)
        return 2
    clock = StageClock.start()
    build_started = time.monotonic()
    cluster = simnodes.create_cluster(args.nodes, args.workdir / "nodes")
    try:
        image = ensure_image(CACHE_DIR, cluster.nodes[0].docker_host)
        print(
            f"{args.nodes} simulated nodes and image {image.ref} ({'built' if image.built else 'cached'}) "
            f"ready in {time.monotonic() - build_started:.1f} s"
        )
        deployment = Deployment(args.workdir, {image.ref: image.archive}, on_operation=_progress(clock))
        # New simulated nodes: a state left by an earlier, interrupted run describes nodes that are gone.
        deployment.state_path.unlink(missing_ok=True)
        config, secret_values = rehearsal_config(
            cluster, image.ref, make_model(args.workdir), pipeline_parallel=args.pp
        )
        clock.started = time.monotonic()  # the deploy itself; bring-up and image build are printed above
        run, _ = deployment.up(config, secret_values)
        endpoint = run.exports["endpoint"]
        answer = chat(endpoint, secret_values["apiKey"], run.exports["servedModelName"])
        _print_stages("deployed:", clock)
        print(f"\nendpoint {endpoint} answered: {answer['choices'][0]['message']['content']!r}")
        print(f"smoke test output: {run.exports['smoke']}")
        if args.keep:
            (args.workdir / "api-key").write_text(secret_values["apiKey"])
            print(
                f'\nkept up. Try:\n  curl -s -H "Authorization: Bearer $(cat {args.workdir}/api-key)" {endpoint}/models'
            )
            print(f"  ssh -F {cluster.ssh_config_path} root@{cluster.nodes[0].mgmt_ip} docker ps")
            print("remove it with: sudo ./rehearse teardown")
            return 0
        destroy_clock = StageClock.start()
        deployment.destroy()
        print(f"destroyed in {time.monotonic() - destroy_clock.started:.1f} s")
        return 0
    finally:
        if not args.keep:
            cluster.close()


def _progress(clock: StageClock):
    def report(operation: Operation) -> None:
        clock.record(operation)
        if operation.action != "same":
            print(f"  {operation.action:<8} {operation.name:<28} {operation.seconds:6.1f} s", flush=True)

    return report


def teardown(workdir: Path) -> int:
    deployment = Deployment(workdir, {})
    if deployment.state_path.exists():
        try:
            deployment.destroy()
        except Exception as error:  # nodes may already be gone; removing them below still cleans up
            print(f"destroy: {error}", file=sys.stderr)
    removed = simnodes.cleanup_stale(force=True)
    print(f"removed simulated clusters: {removed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
