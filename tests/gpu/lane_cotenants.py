"""The GPU lane's co-tenant phase: several deployments on the one GPU, each run exactly as the program renders it for
its node (its own supervisor as a container's main process, the serve handover with its tenancy, readiness, smoke),
all handed their settings at once as `pulumi up` hands them over, then a SIGKILL of one's API server while the
others serve, and the recovery with no `pulumi up`.

    python3 -m tests.gpu.lane --cotenants qwen3-8b:0.30,qwen3-30b-a3b:0.55 --max-model-len 8192 \\
        --extra-args='--load-format dummy --enforce-eager' --out DIR

What it reports (`lane-cotenants.json`): per deployment the memory plan (its pinned KV cache), vLLM's own KV figure
and the difference, when it took and gave back the node's GPU turn, how long until it served; the GPU's use with
every one serving against the sum of their budgets (gpuMemoryUtilization × the GPU's memory); after the kill, how
long until the killed one served again, its KV cache then, and whether the others answered all the while.
`--cotenants-unpinned` renders them as the program did before (no pinned KV cache, no tenancy, a turn of each
supervisor's own): what vLLM issue 55827 does to them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

from components.config import load_cluster_config  # noqa: E402
from components.config.replicas import co_tenants, replicas_of  # noqa: E402
from components.plan.container import tenancy  # noqa: E402
from components.plan.engine import EngineSettings  # noqa: E402
from components.plan.preflight import memory_plan, node_memory  # noqa: E402
from components.plan.serving import handover_params, ready_params, serve_argv, smoke_params  # noqa: E402

KV_LINES = (
    r"reserved ([\d.]+) GiB memory for KV Cache as specified",  # --kv-cache-memory-bytes (gpu_worker.py)
    r"Available KV cache memory: (-?[\d.]+) GiB",  # profiled
)
RECOVERY_SECONDS = 300


def parse(spec: str) -> list[tuple[str, float]]:
    """`qwen3-8b:0.30,qwen3-30b-a3b:0.55` -> [(shape, gpuMemoryUtilization), …]."""
    found = []
    for part in spec.split(","):
        shape, _, share = part.partition(":")
        found.append((shape.strip(), float(share)))
    return found


def deployment_names(shapes: list[tuple[str, float]]) -> list[str]:
    """A deployment's name per shape; the same shape twice is two deployments (`qwen3-8b`, `qwen3-8b-2`), so two
    of the smaller model fit one 80 GiB GPU."""
    names: list[str] = []
    for shape, _ in shapes:
        base = shape.replace(".", "-")
        names.append(
            base if base not in names else f"{base}-{sum(n == base or n.startswith(base + '-') for n in names) + 1}"
        )
    return names


def stack(models: list[tuple[str, str, float]], args, fabric: tuple[str, str]) -> dict:
    """A one-node stack with a deployment for each (name, model directory, share), on ports --port-base, +1, …"""
    return {
        "nodes": [{"name": "gpu-1", "host": "127.0.0.1", "fabricAddress": fabric[0], "fabricInterface": fabric[1]}],
        "image": "lane",
        "apiKey": "lane-cotenants-key",
        "deployments": [
            {
                "name": name,
                "model": model,
                "nodes": ["gpu-1"],
                "executor": "mp",
                "maxModelLen": args.max_model_len,
                "vllm": {
                    "port": args.port_base + index,
                    # its own name: the same shape twice would otherwise be one served name, which the config refuses
                    "servedModelName": name,
                    "gpuMemoryUtilization": share,
                    "extraArgs": list(args.extra_args),
                    "readyTimeoutSeconds": args.ready_timeout,
                },
            }  # fmt: skip
            for index, (name, model, share) in enumerate(models)
        ],
        "router": {"enabled": True},  # rendered as behind the router (the phase starts none): vllm.port each
    }


def kv_of(log: str) -> float | None:
    for pattern in KV_LINES:
        found = re.findall(pattern, log)
        if found:
            return float(found[-1])
    return None


def supervisor_lines(log: str, *needles: str) -> list[str]:
    return [line[16:][:200] for line in log.splitlines() if line.startswith("=== spark-vllm:") and any(
        needle in line for needle in needles)]  # fmt: skip


def run_cotenants(args, lane) -> dict:
    """`lane` is tests.gpu.lane (its Node, nvidia-smi helpers, make_model): one module imports the other only here."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fabric = tuple(args.fabric.split(":", 1)) if args.fabric else lane.machine_address()
    shapes = parse(args.cotenants)
    models = [
        (name, str(lane.make_model(shape, Path(args.models))), share)
        for name, (shape, share) in zip(deployment_names(shapes), shapes, strict=True)
    ]
    raw = stack(models, args, fabric)
    cfg = load_cluster_config(raw)
    key = raw["apiKey"]
    memory = lane.node_memory_line(args.gpu_memory_mib)
    total_mib = (lane.gpu_total_mib() or [args.gpu_memory_mib])[0]
    report: dict = {
        "phase": "cotenants",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": [row[0] for row in lane.nvidia_smi("name")],
        "gpu_total_mib": total_mib,
        "machine": lane.machine_facts(),
        "gpu_used_mib_before": lane.gpu_used_mib(),
        "pinned": not args.cotenants_unpinned,
        "extra_args": list(args.extra_args),
        "max_model_len": args.max_model_len,
        "replicas": {},
    }
    work = Path(args.run_dir).parent / "cotenants"
    shutil.rmtree(work, ignore_errors=True)
    nodes, handovers, readies = {}, {}, {}
    shared_turn = lane.turn_folder()  # the node's GPU turn, one for its replicas
    report["gpu_turn"] = shared_turn  # removed when the lane exits
    for replica in replicas_of(cfg):
        view, name = replica.config, replica.name
        others = co_tenants(cfg, replica)[view.head_node.name] if not args.cotenants_unpinned else []
        model = view.model
        plan = memory_plan(view, lane.fingerprint_stdout(model), [node_memory(view.head_node, memory)],
                           EngineSettings.of(view), pin_kv_cache=bool(others))  # fmt: skip
        argv = serve_argv(view, model, max_num_seqs=plan.set_max_num_seqs, kv_cache_bytes=plan.kv_cache_bytes)
        env = dict(item.split("=", 1) for item in args.env)
        env["SPARK_VLLM_GPU_TURN"] = shared_turn
        if args.cotenants_unpinned:  # as before: no turn to share (each supervisor a turn of its own)
            env["SPARK_VLLM_GPU_TURN"] = lane.turn_folder()
        (work / name).mkdir(parents=True, exist_ok=True)
        nodes[name] = lane.Node(view, work / name / "run", work / name, env)
        handovers[name] = handover_params(view, view.head_node, argv, key, tenancy(view, others))
        served = view.vllm.served_model_name or model  # what the program waits for and asks (serve.py)
        ready = ready_params(view, served, key)
        ready.update(
            log_file=str(work / name / "run" / "vllm.log"), status_file=str(work / name / "run" / "status.json")
        )
        readies[name] = ready
        report["replicas"][name] = {
            "gpu_memory_utilization": view.vllm.gpu_memory_utilization,
            "budget_gib": round(view.vllm.gpu_memory_utilization * total_mib / 1024, 2) if total_mib else None,
            "plan": {**plan.output(), "problems": plan.problems},
            "plan_kv_gib": min(node.kv_room_gib for node in plan.nodes),
            "argv": argv,
        }
    started = time.monotonic()
    for node in nodes.values():  # every container of the node at once, as `pulumi up` (or a reboot) starts them
        node.start()
    results: dict = {}

    def bring_up(name: str) -> None:
        node = nodes[name]
        code, output, _ = node.exec_python("serve_spec.py", handovers[name], 120)
        results[name] = {"handover": code, "handover_said": output.strip().splitlines()[:2]}
        code, output, seconds = node.exec_python("wait_ready.py", readies[name], args.ready_timeout + 60)
        results[name].update(ready=code, ready_seconds=round(time.monotonic() - started, 1), ready_tail=output[-600:])
        if code == 0:
            view = node.cfg
            served = view.vllm.served_model_name or view.model
            results[name]["smoke"] = node.exec_python("smoke.py", smoke_params(view, served, key), 180)[0]

    try:
        threads = [threading.Thread(target=bring_up, args=(name,)) for name in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        lane.wait(lambda: all(node.status().get("serving") for node in nodes.values()), 15)  # as they say it
        report["gpu_used_mib_serving"] = lane.gpu_used_mib()
        for name, node in nodes.items():
            log = node.vllm_log()
            entry = report["replicas"][name]
            entry.update(results.get(name, {}))
            entry["kv_gib"] = kv_of(log)
            if entry["kv_gib"] is not None and entry["plan_kv_gib"]:
                entry["kv_vs_plan_percent"] = round(
                    (entry["kv_gib"] - entry["plan_kv_gib"]) / entry["plan_kv_gib"] * 100, 1
                )
            entry["turn"] = supervisor_lines(log, "GPU turn")
            entry["vllm_starts"] = log.count("vLLM started (pid")
            entry["refused"] = supervisor_lines(log, "did not get its memory", "refused", "GAVE UP")
            entry["status"] = {k: node.status().get(k) for k in ("state", "serving", "restarts_total", "failed")}
        budgets = sum(entry["budget_gib"] or 0 for entry in report["replicas"].values())
        report["budgets_gib"] = round(budgets, 2)
        used = report["gpu_used_mib_serving"]
        report["gpu_used_gib_serving"] = round(sum(used) / 1024, 2) if used else None
        if all(entry.get("ready") == 0 for entry in report["replicas"].values()) and "kill" in args.phases:
            kill_one(nodes, readies, report, lane)
    finally:
        for node in nodes.values():
            lane.stop(node, {})
        report["gpu_used_mib_after_stop"] = lane.gpu_used_mib()
        report["total_seconds"] = round(time.monotonic() - started, 1)
        for name, node in nodes.items():
            (out / f"cotenant-{name}-vllm.log").write_text(node.vllm_log()[-400_000:])
        (out / "lane-cotenants.json").write_text(json.dumps(report, indent=1))
    return report


def kill_one(nodes: dict, readies: dict, report: dict, lane) -> None:
    """SIGKILL of the first deployment's API server while the others serve: they must answer all the while, and it
    must serve again with no `pulumi up`, with the KV cache it had."""
    name = next(iter(nodes))
    node = nodes[name]
    pid = node.status()["vllm_pid"]
    kv_before = kv_of(node.vllm_log())
    others = {other: readies[other]["base_url"] + "/health" for other in nodes if other != name}
    probes = {other: {"ok": 0, "failed": 0} for other in others}
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            for other, url in others.items():
                probes[other]["ok" if get_status(url) == 200 else "failed"] += 1
            time.sleep(0.5)

    prober = threading.Thread(target=probe)
    prober.start()
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        recovery = min(RECOVERY_SECONDS, readies[name]["timeout_seconds"])
        code, output, _ = node.exec_python("wait_ready.py", {**readies[name], "timeout_seconds": recovery},
                                           recovery + 60)  # fmt: skip
    finally:
        stop.set()
        prober.join()
    log = node.vllm_log()
    report["kill"] = {
        "replica": name,
        "serving_again_seconds": round(time.monotonic() - killed, 1) if code == 0 else None,
        "ready_tail": output[-400:],
        "kv_gib_before": kv_before,
        "kv_gib_after": kv_of(log),
        "others_health": probes,
        "restarts_total": node.status().get("restarts_total"),
        "supervisor_said": supervisor_lines(log, "")[-8:],
        "gpu_used_mib_after": lane.gpu_used_mib(),
    }


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status
    except OSError:
        return 0


def summary(report: dict) -> str:
    lines = [f"lane cotenants ({'pinned' if report['pinned'] else 'unpinned'}), GPU {report.get('gpu')}"]
    for name, entry in report["replicas"].items():
        lines.append(
            f"  {name:18} share {entry['gpu_memory_utilization']:<5} ready {entry.get('ready')} at "
            f"{entry.get('ready_seconds')} s, KV vLLM {entry.get('kv_gib')} / plan {entry.get('plan_kv_gib')} GiB "
            f"({entry.get('kv_vs_plan_percent')} %), starts {entry.get('vllm_starts')}, {entry.get('status')}"
        )
        for line in entry.get("turn", [])[:4] + entry.get("refused", [])[:3]:
            lines.append(f"      {line}")
    lines.append(f"  GPU in use with all serving: {report.get('gpu_used_gib_serving')} GiB; budgets "
                 f"{report.get('budgets_gib')} GiB")  # fmt: skip
    if "kill" in report:
        kill = report["kill"]
        lines.append(f"  kill {kill['replica']}: serving again after {kill['serving_again_seconds']} s, KV "
                     f"{kill['kv_gib_before']} -> {kill['kv_gib_after']} GiB, others {kill['others_health']}")  # fmt: skip
    return "\n".join(lines)
