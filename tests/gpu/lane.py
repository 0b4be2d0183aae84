"""The GPU lane: what the program renders for a one-node stack, run for real with vLLM on a GPU machine.

    python3 -m tests.gpu.lane --executor ray --model qwen3-8b --out DIR   (tests/gpu/device.sh run … does this)

No Docker there, so the node's container is played by a process session with the container's
environment (`node_env` and the secret env): in it the supervisor (components/scripts/supervisor.py,
with `supervisor_params`) as the main process, which runs `ray start` from `ray_start_args`; then,
as `docker exec -i … python3 -` would, the scripts the serve step renders with their parameters:
ray_join.py (the cluster wait), serve_spec.py (the handover), wait_ready.py and smoke.py. Then the
faults: a SIGKILL of vLLM's API server only (what the OOM killer or a crash does), waiting for the
supervisor to serve again with no `pulumi up`, and a SIGTERM stop of the supervisor (`docker stop`),
with the GPU memory left after it. Beside vLLM's own KV cache figures, the memory plan the program
would make from the model's fingerprint and the node's memory (preflight's nvidia-smi query).

Writes one JSON report (`lane-<executor>-<model>.json`) and the logs to --out; prints a summary.
With `--vllm-standin` it runs the stand-in vLLM instead (tests/gpu/test_lane.py does, in CI): the
same steps, so the lane itself is tested where there is no GPU.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from components.config import load_cluster_config  # noqa: E402
from components.plan.container import cluster_wait_params, node_env, supervisor_params  # noqa: E402
from components.plan.engine import EngineSettings  # noqa: E402
from components.plan.names import RUN_DIR  # noqa: E402
from components.plan.preflight import memory_plan, node_memory  # noqa: E402
from components.plan.programs import last_json, printed, script, script_program  # noqa: E402
from components.plan.serving import (  # noqa: E402
    answers_params,
    benchmark_params,
    handover_params,
    ready_params,
    serve_argv,
    smoke_params,
)
from components.scripts.node_contract import (  # noqa: E402
    AnswersResult,
    BenchmarkFigures,
    ClusterSeen,
    Fault,  # noqa: E402
    HandoverResult,
    ImageFacts,
    KeeperResult,
    ReadyResult,
    SmokeResult,
)
from tests.gpu.lane_cotenants import run_cotenants  # noqa: E402
from tests.gpu.lane_cotenants import summary as cotenants_summary  # noqa: E402
from tests.gpu.lane_router import router_phase  # noqa: E402
from tests.gpu.model import SHAPES, make_model  # noqa: E402

# What each script the lane runs prints, as the program reads it (its last JSON line through the contract;
# the handover's and the router keeper's through printed(), as serve.py and cluster.py do): real vLLM's output meets the contract here.
RESULTS = {
    "ray_join.py": ClusterSeen,
    "serve_spec.py": HandoverResult,
    "wait_ready.py": ReadyResult,
    "smoke.py": SmokeResult,
    "node_answers.py": AnswersResult,
    "node_benchmark.py": BenchmarkFigures,
    "image_probe.py": ImageFacts,
    "router_keeper.py": KeeperResult,
}
NODE_MARK = "SPARK_VLLM_LANE_NODE"  # in the environment of every process of one lane's node (processes_named)
PRINTED = ("serve_spec.py", "router_keeper.py")  # read as the program reads them: printed(), a line or none


def read_result(name: str, output: str) -> dict:
    """What the program makes of `name`'s output: its result contract's fields, or why it could not read it."""
    try:
        found = printed(output) if name in PRINTED else last_json(output)
        return RESULTS[name].from_json(found).to_json()
    except (ValueError, TypeError, AttributeError) as error:
        return {"error": f"{type(error).__name__}: {error}", "tail": output.strip()[-1500:]}


KV_PATTERNS = {
    "available_kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "model_loading_gib": r"Model loading took ([\d.]+) GiB",
    # a hybrid model's cache (vllm/platforms/interface.py, vllm/config/compilation.py)
    "attention_block_tokens": r"Setting attention block size to (\d+) tokens",
    "mamba_padding_percent": r"Padding mamba page size by ([\d.]+)%",
    "mamba_cache_blocks_refused": r"exceeds available Mamba cache blocks \((\d+)\)",
}
# Where a restart's time goes: the first line of each of vLLM's processes, and its milestones.
TIMELINE_MARKS = (
    ("api server's first line", "(APIServer pid="),
    ("engine core's first line", "(EngineCore pid="),
    ("Ray worker's first line", "(RayWorkerProc pid="),
    ("model loaded", "Model loading took"),
    ("torch.compile done", "torch.compile took"),
    ("CUDA graphs captured", "Graph capturing finished"),
    ("engine initialised", "init engine (profile"),
    ("API server listening", "Starting vLLM server on"),
)
LOG_TIME = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")
IMPORT_PROBE = "import time; t = time.monotonic(); import {module}; print(round(time.monotonic() - t, 2))"
RECOVERY_TIMEOUT = 240  # a call on the GPU machine lasts at most 10 minutes: every wait ends well before
STOP_TIMEOUT = 120


def machine_address() -> tuple[str, str]:
    """This machine's first IPv4 address off loopback, and its interface: the lane's 'fabric'. Ray does
    not keep a loopback --node-ip-address (it registered 192.0.2.2 for 127.0.0.1 on the GPU machine)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == 2 and not address.address.startswith("127."):
                return address.address, name
    return "127.0.0.1", "lo"


def stack_config(
    executor: str,
    model: str,
    max_model_len: int,
    utilization: float,
    extra_args: list[str],
    fabric: tuple[str, str],
    tensor_parallel: int = 1,
    port_base: int = 8000,
) -> dict:
    """The stack config of a one-node stack on this machine (`fabric`: its address and interface; with
    `tensor_parallel` above 1, that many of its GPUs, tensor-parallel); its listeners on `port_base` and the six
    ports after it (the endpoint's, vLLM's behind the edge, the edge's own, and the router's three: several lanes
    on one machine, the tests', stay apart)."""
    node = {"name": "gpu-1", "host": "127.0.0.1", "fabricAddress": fabric[0], "fabricInterface": fabric[1],
            "gpus": tensor_parallel}  # fmt: skip
    return {
        "nodes": [node],
        "image": "lane",
        "model": model,
        "executor": executor,
        "tensorParallelSize": tensor_parallel,
        "maxModelLen": max_model_len,
        "vllm": {
            "gpuMemoryUtilization": utilization,
            "reasoningParser": "qwen3",
            "toolCallParser": "qwen3_coder",
            "enableAutoToolChoice": True,
            "extraArgs": extra_args,
            "readyTimeoutSeconds": 420,
            "port": port_base,
        },
        "edge": {"vllmPort": port_base + 1, "metricsPort": port_base + 2},
        "ray": {"dashboard": False},  # plain `ray` has no dashboard packages (see the image check)
        "apiKey": "lane-" + secrets.token_hex(8),
    }


def nvidia_smi(query: str) -> list[list[str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.strip().splitlines()]


def gpu_used_mib() -> list[float]:
    return [float(row[0]) for row in nvidia_smi("memory.used") if row and row[0].replace(".", "", 1).isdigit()]


def gpu_total_mib() -> list[float]:
    return [float(row[0]) for row in nvidia_smi("memory.total") if row and row[0].replace(".", "", 1).isdigit()]


def machine_facts() -> dict:
    """Which machine a report ran on: each GPU (name, memory), the driver, the kernel, Python, and the versions of
    torch (its CUDA build), vLLM, Ray and vllm-router where the lane runs (None: not installed there, as the
    stand-in's CI has no torch)."""

    def version(distribution: str) -> str | None:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None

    rows = nvidia_smi("name,memory.total,driver_version")
    return {
        "gpus": [{"name": row[0], "memory_mib": float(row[1])} for row in rows if len(row) == 3],
        "driver": rows[0][2] if rows and len(rows[0]) == 3 else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        **{name: version(name) for name in ("torch", "vllm", "ray", "vllm-router")},
    }


def turn_folder() -> str:
    """A node's GPU turn: a folder of the lane's own (the container's volume on a node), short, as a Unix socket's
    path must be, and removed when the lane exits (they were left behind, one or more a run)."""
    folder = tempfile.mkdtemp(prefix="svturn-", dir="/tmp")
    atexit.register(shutil.rmtree, folder, True)
    return folder


class Node:
    """The node's container, played by a process session with the container's environment."""

    def __init__(self, cfg, run_dir: Path, out: Path, extra_env: dict[str, str]):
        self.cfg = cfg
        self.node = cfg.head_node
        self.out = out
        self.run_dir = run_dir
        env = dict(os.environ)
        for item in node_env(cfg, self.node):
            key, value = item.split("=", 1)
            env[key] = value
        if cfg.executor == "ray" and cfg.ray.auth == "token":
            env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # the program's ray-auth-token, in the secret env
        env["SPARK_VLLM_GPU_TURN"] = turn_folder()
        env.update(extra_env)
        env[NODE_MARK] = secrets.token_hex(8)  # what tells this node's processes from another lane's
        self.env = env
        self.supervisor = None
        self.reads: list[dict] = []  # each script run's result as the program reads it (RESULTS), in order

    def start(self) -> None:
        params = supervisor_params(self.cfg, self.node)
        params["run_dir"] = str(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.log = open(self.out / "supervisor.log", "w")
        program = self.out / "supervisor.py"  # a file, as the container has it (too long for an argument)
        program.write_text(script("supervisor.py"))
        self.supervisor = subprocess.Popen(
            [sys.executable, "-u", str(program), json.dumps(params, sort_keys=True)],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # as a container's main process: its own session
            cwd="/",
        )

    def exec_python(self, name: str, params: dict, timeout: float) -> tuple[int, str, float]:
        """`docker exec -i CONTAINER python3 -` of a rendered script; (exit code, output, seconds): 124 and what it
        said by then when it ran past `timeout`, as `timeout(1)` says it."""
        if "run_dir" in params:  # the container's RUN_DIR is this lane's run directory
            params = {**params, "run_dir": str(self.run_dir)}
        program = script_program(name, params)
        started = time.monotonic()
        try:
            result = subprocess.run(
                [sys.executable, "-"], input=program, env=self.env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as expired:
            said = [part.decode(errors="replace") if isinstance(part, bytes) else part or "" for part in
                    (expired.stdout, expired.stderr)]  # fmt: skip
            return 124, "".join(said) + f"\n(ran past {timeout:g} s)", time.monotonic() - started
        if result.returncode == 0:
            self.record(name, result.stdout)
        return result.returncode, result.stdout + result.stderr, time.monotonic() - started

    def record(self, name: str, stdout: str) -> None:
        """`name`'s output as the program reads it, kept in `reads` (a script without a result contract: none)."""
        if name in RESULTS:
            read = read_result(name, stdout)
            said = {"error": read} if "error" in read else {}
            self.reads.append({"script": name, "read": not said, **said})

    def status(self) -> dict:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def vllm_log(self) -> str:
        try:
            return (self.run_dir / "vllm.log").read_text(errors="replace")
        except OSError:
            return ""


def log_seconds(line: str, year: int) -> float | None:
    """The time (epoch seconds) of a line of vLLM's log ("INFO 12-01 20:44:25 …", and the supervisor's
    "=== spark-vllm: 12-01 20:44:21 …"; both local time, as vLLM's logging writes it), or None."""
    found = LOG_TIME.search(line)
    if not found:
        return None
    month, day, hour, minute, second = (int(part) for part in found.groups())
    return time.mktime((year, month, day, hour, minute, second, 0, 0, -1))


def restart_timeline(log: str, killed_at: float) -> list[dict]:
    """What the log says happened after the kill (epoch seconds `killed_at`): each of the supervisor's
    lines, then the first line of each TIMELINE_MARKS, as seconds after the kill (whole seconds: the
    log's resolution)."""
    year = time.gmtime(killed_at).tm_year
    events, marks = [], dict(TIMELINE_MARKS)
    restarted = False
    for line in log.splitlines():
        at = log_seconds(line, year)
        if at is None or at < int(killed_at):
            continue
        if line.startswith("=== spark-vllm:"):
            text = LOG_TIME.split(line, 1)[-1].strip()
            events.append({"at": round(at - killed_at, 1), "what": "supervisor: " + text[:120]})
            restarted = restarted or text.startswith("vLLM started")
            continue
        if not restarted:
            continue
        for label, needle in list(marks.items()):
            if needle in line:
                events.append({"at": round(at - killed_at, 1), "what": label})
                del marks[label]
    return events


def import_seconds(env: dict) -> dict:
    """How long a fresh Python takes to import what each of vLLM's processes imports first (twice: the
    second with the page cache warm), in the node's environment."""
    found = {}
    for module in ("torch", "vllm.entrypoints.cli.main"):
        times = []
        for _ in range(2):
            result = subprocess.run(
                [sys.executable, "-c", IMPORT_PROBE.format(module=module)],
                env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            times.append(float(result.stdout.strip()) if result.returncode == 0 else result.stderr.strip()[-300:])
        found[module] = times
    return found


def fingerprint_stdout(model_dir: str) -> str:
    return subprocess.run(
        [sys.executable, "-", model_dir], input=script("model_fingerprint.py"), capture_output=True, text=True
    ).stdout


def node_memory_line(gpu_memory_mib: float | None = None) -> str:
    """The memory line preflight_node.sh prints: MemTotal, and nvidia-smi's memory.total per GPU (or
    `gpu_memory_mib`: a stand-in GPU's, where there is no nvidia-smi to say it)."""
    total_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    gpus = [str(gpu_memory_mib)] if gpu_memory_mib else [row[0] for row in nvidia_smi("memory.total")]
    return json.dumps({"mem_total_bytes": total_kib * 1024, "gpu_memory_mib": gpus})


def kv_figures(log: str) -> dict:
    found = {}
    for key, pattern in KV_PATTERNS.items():
        matches = re.findall(pattern, log)
        if matches:
            found[key] = float(matches[0].replace(",", ""))
    return found


def get(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def chat_answer(base: str, key: str, model: str) -> dict:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Reply with the single word: ready"}],
            "max_tokens": 16,
            "temperature": 0,
        }  # fmt: skip
    ).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    message = answer["choices"][0]["message"]
    return {
        "message_keys": sorted(k for k, v in message.items() if v not in (None, [], "")),
        "content": message.get("content"),
        "reasoning": (message.get("reasoning") or message.get("reasoning_content") or "")[:80],
        "finish_reason": answer["choices"][0].get("finish_reason"),
        "completion_tokens": answer.get("usage", {}).get("completion_tokens"),
    }


def wait(condition, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    return None


def forget_caches(keep: tuple[str, ...]) -> list[str]:
    """What a new container starts without: the compile caches of an earlier vLLM on this machine (Triton's,
    Inductor's, FlashInfer's, ~/.cache's others) except those under `keep` (the ones a volume would keep)."""
    home = Path.home()
    found = [home / ".triton", *Path("/tmp").glob("torchinductor_*")]
    found += [path for path in (home / ".cache").glob("*") if path.name not in keep]
    removed = []
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(str(path))
    return removed


def stable_api_key(path: Path) -> str:
    """One key for every run on this machine, as a stack's apiKey is the same for each container it
    creates: vLLM hashes VLLM_API_KEY into its compile cache key with mp, so a new key is a cache miss."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("lane-" + secrets.token_hex(8))
        path.chmod(0o600)
    return path.read_text().strip()


def run_lane(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    forgotten = forget_caches(tuple(args.keep_caches.split(","))) if args.keep_caches is not None else None
    model_dir = str(make_model(args.model, Path(args.models)))
    fabric = tuple(args.fabric.split(":", 1)) if args.fabric else machine_address()
    raw = stack_config(args.executor, model_dir, args.max_model_len, args.utilization, args.extra_args, fabric,
                       args.tensor_parallel, args.port_base)  # fmt: skip
    if args.stable_key:
        raw["apiKey"] = stable_api_key(Path(args.models).parent / "api-key")
    if args.max_num_seqs is not None:
        raw["vllm"]["maxNumSeqs"] = args.max_num_seqs
    raw["vllm"].update(stallSeconds=args.stall_seconds, canarySeconds=args.stall_seconds)
    if args.speculative:
        method, _, tokens = args.speculative.partition(":")
        raw["vllm"]["speculative"] = {"method": method, "tokens": int(tokens or 1)}
    cfg = load_cluster_config(raw)
    api_key = raw["apiKey"]
    served = cfg.vllm.served_model_name or model_dir
    node = Node(cfg, Path(args.run_dir), out, dict(item.split("=", 1) for item in args.env))
    report: dict = {
        "executor": args.executor,
        "model": args.model,
        "phases": list(args.phases),
        "tensor_parallel_size": args.tensor_parallel,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.utilization,
        "date": time.strftime("%Y-%m-%d"),
        "gpu": [row[0] for row in nvidia_smi("name")],
        "machine": machine_facts(),
        "gpu_used_mib_before": gpu_used_mib(),
        "steps": {},
    }
    if forgotten is not None:
        report["caches_forgotten"] = forgotten
    report["api_key_stable"] = bool(args.stable_key)
    report["gpu_turn"] = node.env["SPARK_VLLM_GPU_TURN"]  # removed when the lane exits
    try:
        report["vllm_version"] = subprocess.run(
            ["vllm", "--version"], env=node.env, capture_output=True, text=True, timeout=120
        ).stdout.strip()[-40:]
    except (OSError, subprocess.SubprocessError) as error:
        report["vllm_version"] = f"unknown ({error})"
    steps = report["steps"]
    if "imports" in args.phases:
        report["import_seconds"] = import_seconds(node.env)
    probe = subprocess.run(
        [sys.executable, "-"], input=script("image_probe.py"), env=node.env, capture_output=True, text=True, timeout=300
    )
    report["image_probe"] = read_result("image_probe.py", probe.stdout) if probe.returncode == 0 else probe.stderr
    report["contract_reads"] = node.reads

    def step(name: str, code: int, output: str, seconds: float) -> bool:
        steps[name] = {"ok": code == 0, "seconds": round(seconds, 1), "tail": output.strip().splitlines()[-3:]}
        (out / f"{name}.out").write_text(output)
        save(report, out)  # after every step: a call cut off at its time limit still brings back what ran
        print(f"lane: {name}: {'ok' if code == 0 else 'FAILED'} in {seconds:.1f} s", flush=True)
        return code == 0

    fingerprint = fingerprint_stdout(model_dir)
    plan = memory_plan(
        cfg, fingerprint, [node_memory(cfg.head_node, node_memory_line(args.gpu_memory_mib))], EngineSettings.of(cfg)
    )
    report["memory_plan"] = {**plan.output(), "problems": plan.problems, "notes": plan.notes()}
    started = time.monotonic()
    node.start()
    try:
        if cfg.executor == "ray":
            params = cluster_wait_params(cfg)
            if not step("cluster_ready", *node.exec_python("ray_join.py", params, params["timeout_seconds"] + 60)):
                return report
        argv = serve_argv(cfg, model_dir, max_num_seqs=plan.set_max_num_seqs)  # as the program renders it
        handover_at = time.monotonic()
        if not step(
            "handover", *node.exec_python("serve_spec.py", handover_params(cfg, node.node, argv, api_key), 180)
        ):
            return report
        ready = ready_params(cfg, served, api_key)
        ready.update(log_file=str(node.run_dir / "vllm.log"), status_file=str(node.run_dir / "status.json"))
        code, output, _ = node.exec_python("wait_ready.py", ready, cfg.vllm.ready_timeout_seconds + 60)
        step("ready", code, output, time.monotonic() - handover_at)
        report["kv"] = kv_figures(node.vllm_log())
        if code:
            status = node.status()
            report["supervisor_at_failure"] = {key: status.get(key) for key in ("state", "failed", "restarts_total")}
            report["vllm_starts"] = node.vllm_log().count("vLLM started (pid")
            return report
        report["ray_env_lines"] = [
            line[-300:]
            for line in node.vllm_log().splitlines()
            if "RAY_NON_CARRY_OVER_ENV_VARS" in line or "Copying the following environment variables" in line
        ][:4]
        if cfg.executor == "ray":  # Ray's processes once vLLM serves: none idle (node_ray_keeper.py RAY_ENV)
            report["ray_processes"] = ray_processes(node)
        report["gpu_used_mib_serving"] = gpu_used_mib()
        base = ready["base_url"]
        report["api_key_enforced"] = get(base + "/v1/models") == 401 and get(base + "/v1/models", api_key) == 200
        step("smoke", *node.exec_python("smoke.py", smoke_params(cfg, served, api_key), 180))
        try:
            report["answer"] = chat_answer(base, api_key, served)
        except (OSError, ValueError, KeyError) as error:
            report["answer"] = {"error": str(error)}
        if "answers" in args.phases:
            answers_phase(node, cfg, served, api_key, report, step, args)
        if "router" in args.phases:
            router_phase(raw, node, served, api_key, report, step)
        if "bench" in args.phases:
            benchmark(node, cfg, served, model_dir, api_key, report, step)
        if "metrics" in args.phases:  # what vLLM's /metrics says (the stand-in serves the same names)
            with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
                text = response.read().decode()
            (out / "metrics.txt").write_text(text)
            report["metric_names"] = sorted(
                {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
            )
        if "stall" in args.phases:
            stall_and_recover(node, cfg, served, api_key, ready, report, step, args.stall_target)
        if "kill" in args.phases:
            for round_ in range(args.kills):
                suffix = f"_{round_ + 1}" if round_ else ""
                kill_and_recover(node, cfg, served, api_key, ready, report, step, suffix)
    finally:
        stop(node, report)  # always: nothing of the lane may outlive it
        report["total_seconds"] = round(time.monotonic() - started, 1)
        (out / "vllm.log").write_text(node.vllm_log())
    return report


def answers_phase(node: Node, cfg, served: str, api_key: str, report: dict, step, args) -> None:
    """The validation's greedy answers (node_answers.py, as the program renders it), kept in --answers-save;
    with --answers-baseline (an earlier run's file: the same model without speculation) compared with them.
    A disagreement is recorded, not a failed lane: the lane measures how often it happens."""
    baseline = None
    if args.answers_baseline and Path(args.answers_baseline).exists():
        baseline = json.loads(Path(args.answers_baseline).read_text())
    params = answers_params(cfg, served, api_key, baseline)
    code, output, seconds = node.exec_python("node_answers.py", params, 600)
    result = read_result("node_answers.py", output)
    step("answers", 1 if "error" in result else 0, output, seconds)
    report["answers"] = result
    report["answers_exit"] = code
    if args.answers_save and "answers" in result:
        Path(args.answers_save).write_text(json.dumps(result["answers"]))
    # the same questions again: is a model's greedy answer stable from one request to the next here?
    if baseline is None and "answers" in result:
        again = answers_params(cfg, served, api_key, result["answers"])
        code, output, _ = node.exec_python("node_answers.py", again, 600)
        repeat = read_result("node_answers.py", output)
        report["answers_repeat_agreement"] = repeat.get("agreement", repeat)


def benchmark(node: Node, cfg, served: str, model_dir: str, api_key: str, report: dict, step) -> None:
    """The deploy's benchmark step (node_benchmark.py, the stack's default load) with each tool: the
    project's own load, then the image's `vllm bench serve`."""
    report["benchmark"] = {}
    for tool in ("spark-vllm", "vllm"):
        params = benchmark_params(cfg, served, model_dir, api_key) | {"tool": tool}
        params["measuring_file"] = str(node.run_dir / "measuring")  # the supervisor's run directory here
        code, output, seconds = node.exec_python("node_benchmark.py", params, params["timeout_seconds"] + 360)
        step(f"benchmark_{tool}", code, output, seconds)
        report["benchmark"][tool] = read_result("node_benchmark.py", output) if code == 0 else {"error": output[-2000:]}


def kill_and_recover(
    node: Node, cfg, served: str, api_key: str, ready: dict, report: dict, step, suffix: str = ""
) -> None:
    """SIGKILL of vLLM's API server alone; the supervisor must serve again, with no `pulumi up`.
    Reported as `after_kill{suffix}` and the step `recovery{suffix}`."""
    before = node.status()
    pid = before["vllm_pid"]
    group = subprocess.run(["ps", "-o", "pid=,comm=", "-g", str(pid)], capture_output=True, text=True).stdout
    killed_at, killed_wall = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    report[f"after_kill{suffix}"] = {
        "group_before": group.split("\n")[:8],
        "gpu_used_mib_2s_after": gpu_used_mib(),
    }
    restarted = wait(lambda: node.status().get("vllm_pid") not in (None, pid), RECOVERY_TIMEOUT)
    report[f"after_kill{suffix}"]["restarted_seconds"] = round(time.monotonic() - killed_at, 1) if restarted else None
    code, output, _ = node.exec_python("wait_ready.py", ready, RECOVERY_TIMEOUT)
    smoke = node.exec_python("smoke.py", smoke_params(cfg, served, api_key), 180)
    seconds = time.monotonic() - killed_at
    step(f"recovery{suffix}", code or smoke[0], output + smoke[1], seconds)
    status = node.status()
    report[f"after_kill{suffix}"].update(
        serving_again_seconds=round(seconds, 1) if not (code or smoke[0]) else None,
        restarts_total=status.get("restarts_total"),
        supervisor_said=[line for line in node.vllm_log().splitlines() if "=== spark-vllm:" in line][-8:],
        timeline=restart_timeline(node.vllm_log(), killed_wall),
    )


def processes_named(prefix: str, node: Node) -> list[int]:
    """The node's processes whose name (/proc/PID/comm, 15 characters) starts with `prefix`: those whose environment
    carries the node's NODE_MARK (Ray's workers too, which raylet starts outside the node's session), never another
    lane's on the same machine (CI runs several side by side)."""
    mark = f"{NODE_MARK}={node.env[NODE_MARK]}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or not Path(f"/proc/{entry}/comm").read_text().strip().startswith(prefix):
                continue
            if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            pass
    return found


def ray_processes(node: Node) -> dict:
    """How many of each of the node's `ray::` processes there are once vLLM serves (`ray::IDLE`: a worker Ray started
    ahead for tasks vLLM never sends, one per CPU it counts without RAY_prestart_worker_first_driver=0), and the
    CPUs the machine has: the count Ray would have started."""
    counts: dict = {}
    for pid in processes_named("ray::", node):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        counts[name] = counts.get(name, 0) + 1
    return {"cpus": os.cpu_count(), "by_name": dict(sorted(counts.items()))}


class Stream:
    """A streamed completion of many tokens (ignore_eos), read in a thread: chunks so far, how it ended."""

    def __init__(self, base: str, key: str, model: str):
        body = {"model": model, "prompt": "Tell a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        self.request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                              headers={"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {key}"})  # fmt: skip
        self.chunks, self.finished, self.error = 0, False, None
        self.thread = __import__("threading").Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        try:
            with urllib.request.urlopen(self.request, timeout=RECOVERY_TIMEOUT) as response:
                for line in response:
                    self.finished = self.finished or line.startswith(b"data: [DONE]")
                    self.chunks += line.startswith(b"data: {")
        except (OSError, ValueError) as error:
            self.error = f"{type(error).__name__}: {str(error)[:200]}"


def stall_and_recover(node: Node, cfg, served: str, api_key: str, ready: dict, report: dict, step, target: str) -> None:
    """While a request streams, SIGSTOP of vLLM's engine core (`target` engine) or of a Ray worker actor
    (`worker`): /health stays 200 and nothing moves; the supervisor must find it stalled (vllm.stallSeconds), end
    vLLM as a whole and serve again. Reported as `stall` and the step `stall_recovery`."""
    pid = node.status()["vllm_pid"]
    canary = node.run_dir / "canary.json"
    wait(canary.exists, 60)  # the canary's reference, asked while vLLM idles: what real vLLM answers it
    stream = Stream(ready["base_url"], api_key, served)
    wait(lambda: stream.chunks >= 20, 60)
    victims = processes_named("VLLM::EngineCor" if target == "engine" else "ray::RayWorker", node)
    stopped_at = time.monotonic()
    for victim in victims:
        os.kill(victim, signal.SIGSTOP)
    time.sleep(2)
    at, health = stream.chunks, get(ready["base_url"] + "/health")
    found = wait(lambda: (node.status().get("faults") or {}).get(Fault.STALLED), cfg.vllm.stall_seconds + 60)
    found_seconds = round(time.monotonic() - stopped_at, 1) if found else None
    moved = stream.chunks - at
    restarted = wait(lambda: node.status().get("vllm_pid") not in (None, pid), RECOVERY_TIMEOUT)
    code, output, _ = node.exec_python("wait_ready.py", ready, RECOVERY_TIMEOUT)
    smoke = node.exec_python("smoke.py", smoke_params(cfg, served, api_key), 180)
    seconds = time.monotonic() - stopped_at
    step("stall_recovery", code or smoke[0] or not found, output + smoke[1], seconds)
    status = node.status()
    report["stall"] = {
        "target": target, "stopped": [f"{v} {Path(f'/proc/{v}/comm').read_text().strip()}" for v in victims
                                      if Path(f"/proc/{v}").exists()][:4] or [str(v) for v in victims],
        "health_while_stopped": health, "chunks_while_stopped": moved, "stall_seconds": cfg.vllm.stall_seconds,
        "found_seconds": found_seconds, "restarted": restarted,
        "serving_again_seconds": round(seconds, 1) if not (code or smoke[0]) and found else None,
        "stream_finished": stream.finished, "stream_error": stream.error,
        "last_fault": {k: (status.get("last_fault") or {}).get(k) for k in ("kind", "detail")},
        "last_exit": status.get("last_exit"), "restarts_total": status.get("restarts_total"),
        "canary": json.loads(canary.read_text()) if canary.exists() else None,
        "supervisor_said": [line for line in node.vllm_log().splitlines() if "=== spark-vllm:" in line][-10:],
    }  # fmt: skip
    for victim in victims:  # whatever is left of them (the supervisor ended vLLM's own)
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass


def stop(node: Node, report: dict) -> None:
    """SIGTERM to the supervisor (`docker stop`): vLLM and Ray stopped, the GPU freed."""
    if node.supervisor is None or node.supervisor.poll() is not None:
        return
    at = time.monotonic()
    node.supervisor.send_signal(signal.SIGTERM)
    try:
        code = node.supervisor.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(node.supervisor.pid, signal.SIGKILL)
    seconds = time.monotonic() - at
    time.sleep(1)
    left = subprocess.run(["ps", "-o", "pid=,comm=", "-s", str(node.supervisor.pid)], capture_output=True, text=True)
    report["stop"] = {
        "exit_code": code,
        "seconds": round(seconds, 1),
        "gpu_used_mib_after": gpu_used_mib(),
        "processes_left": [line.strip() for line in left.stdout.splitlines() if line.strip()],
    }
    print(f"lane: stop: exit {code} in {seconds:.1f} s, GPU used after: {report['stop']['gpu_used_mib_after']}")


def report_path(report: dict, out: Path) -> Path:
    tp = report.get("tensor_parallel_size", 1)
    return out / f"lane-{report['executor']}-{report['model']}{f'-tp{tp}' if tp > 1 else ''}.json"


def save(report: dict, out: Path) -> None:
    report_path(report, out).write_text(json.dumps(report, indent=1))


def summary(report: dict) -> str:
    kv, plan = report.get("kv", {}), report.get("memory_plan", {})
    room = next(iter(plan.get("nodes", {}).values()), {}).get("kv_room_gib")
    lines = [f"lane {report['executor']} {report['model']} ({report.get('vllm_version')}, {report.get('gpu')})"]
    for name, info in report["steps"].items():
        lines.append(f"  {name:14} {'ok' if info['ok'] else 'FAILED':6} {info['seconds']:7.1f} s")
    if kv.get("available_kv_cache_gib"):
        share = (
            f" ({(room - kv['available_kv_cache_gib']) / kv['available_kv_cache_gib'] * 100:+.1f} %)" if room else ""
        )
        lines.append(f"  KV cache: vLLM {kv.get('available_kv_cache_gib')} GiB, plan {room} GiB{share}; {kv}")
    for tool, figures in (report.get("benchmark") or {}).items():
        shown = {key: figures.get(key) for key in ("outputTokensPerSecond", "requestsPerSecond", "ttftMs", "itlMs",
                                                  "tpotMs", "speculative", "errors", "error")}  # fmt: skip
        lines.append(f"  benchmark {tool}: {json.dumps(shown)[:600]}")
    if report.get("stall"):
        shown = {name: value for name, value in report["stall"].items() if name not in ("canary", "supervisor_said")}
        lines.append(f"  stall: {json.dumps(shown)[:900]}")
        lines.append(f"  canary: {json.dumps(report['stall'].get('canary'))[:400]}")
    for key in sorted(key for key in report if key.startswith("after_kill")):
        after = {name: value for name, value in report[key].items() if name != "timeline"}
        lines.append(f"  {key}: {json.dumps(after)[:600]}")
        for event in report[key].get("timeline", []):
            lines.append(f"    {event['at']:6.1f} s  {event['what']}")
    hybrid = plan.get("hybridCache")
    if hybrid:
        seqs = plan.get("maxNumSeqs") or {}
        lines.append(
            f"  hybrid cache: block vLLM {kv.get('attention_block_tokens')} / plan {hybrid['blockTokens']} tokens, "
            f"padding vLLM {kv.get('mamba_padding_percent')} / plan {hybrid['statePaddingPercent']} %; blocks: plan "
            f"{seqs.get('cacheBlocks')} (kept {seqs.get('kept')}), vLLM refused at {kv.get('mamba_cache_blocks_refused')}; "
            f"max_num_seqs wanted {seqs.get('wanted')}, set {seqs.get('set')}; concurrency vLLM "
            f"{kv.get('max_concurrency')} / plan {next(iter(plan.get('nodes', {}).values()), {}).get('max_sequences')}"
        )
    if "answers" in report:
        answers = report["answers"]
        lines.append(
            f"  answers: {len(answers.get('answers') or [])}, agreement {json.dumps(answers.get('agreement'))[:600]}; "
            f"repeat {json.dumps(report.get('answers_repeat_agreement'))[:300]}"
        )
    if plan.get("speculative"):
        lines.append(f"  plan speculative: {json.dumps(plan['speculative'])}")
    if report.get("supervisor_at_failure"):
        lines.append(
            f"  supervisor: {json.dumps(report['supervisor_at_failure'])[:500]}; starts {report.get('vllm_starts')}"
        )
    if "import_seconds" in report:
        lines.append(f"  imports (fresh python, twice): {json.dumps(report['import_seconds'])}")
    if "stop" in report:
        lines.append(f"  stop: {json.dumps(report['stop'])}")
    return "\n".join(lines)


PHASES = ("imports", "answers", "router", "bench", "metrics", "stall", "kill")


def phase_list(text: str) -> tuple[str, ...]:
    """--phases: names of PHASES, comma-separated ('' for none); another name is refused."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in PHASES]
    if unknown:
        raise argparse.ArgumentTypeError(f"no phase {', '.join(unknown)} (the phases: {', '.join(PHASES)})")
    return names


def argument_parser() -> argparse.ArgumentParser:
    """The lane's arguments (tests/gpu/recipe.py's runs are checked against them)."""
    parser = argparse.ArgumentParser(prog="tests.gpu.lane", description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=("ray", "mp"), default="ray")
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="vllm.maxNumSeqs by hand (default auto): the plan's verdict is recorded, and vLLM runs with it anyway",
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="tensorParallelSize on the one node, with that many of the machine's GPUs (nodes[].gpus)",
    )
    parser.add_argument("--speculative", default=None, help="vllm.speculative as METHOD:TOKENS, e.g. mtp:3")
    parser.add_argument("--answers-save", default=None, help="with 'answers': keep this run's answers in FILE")
    parser.add_argument(
        "--answers-baseline", default=None, help="with 'answers': compare with FILE (a run without speculation)"
    )
    parser.add_argument("--utilization", type=float, default=0.9)
    parser.add_argument(
        "--extra-args",
        type=shlex.split,
        default=["--load-format", "dummy"],
        help="vllm.extraArgs as one string: --extra-args='--load-format dummy --language-model-only'",
    )
    parser.add_argument(
        "--phases",
        default="kill",
        type=phase_list,
        help="after ready and smoke, comma-separated, run in this order whatever the order given: 'imports' (import "
        "times first), 'answers' (the validation's greedy answers), 'router' (the stack's router in front: "
        "tests/gpu/lane_router.py), 'bench' (the benchmark, both tools), 'metrics' (/metrics to metrics.txt), "
        "'stall' (a SIGSTOP while a request streams: found and served again), 'kill' (and recover); a stop ends "
        "every run",
    )
    parser.add_argument("--kills", type=int, default=1, help="with 'kill': how many SIGKILLs, one recovery each")
    parser.add_argument(
        "--stall-target",
        choices=("engine", "worker"),
        default="engine",
        help="with 'stall': SIGSTOP vLLM's engine core, or (Ray) its worker actors",
    )
    parser.add_argument("--stall-seconds", type=int, default=30, help="vllm.stallSeconds (and canarySeconds)")
    parser.add_argument(
        "--keep-caches",
        default=None,
        help="start as a new container would: remove the compile caches of earlier runs (~/.triton, "
        "/tmp/torchinductor_*, ~/.cache/*) except these names under ~/.cache, comma-separated (e.g. vllm,huggingface)",
    )
    parser.add_argument(
        "--stable-key",
        action="store_true",
        help="the same API key as the machine's earlier --stable-key runs (a stack's key), not a new one per run",
    )
    parser.add_argument("--models", default="/var/tmp/lane/models")
    parser.add_argument("--run-dir", default=RUN_DIR)
    parser.add_argument("--out", default=os.environ.get("OUT", "/var/tmp/lane/out"))
    parser.add_argument("--fabric", default=None, help="ADDRESS:INTERFACE (default: the first off loopback)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE added to the node's environment")
    parser.add_argument(
        "--cotenants",
        default=None,
        help="SHAPE:SHARE,… several deployments on the one GPU, handed their settings at once, then a SIGKILL of "
        "the first (tests/gpu/lane_cotenants.py); --phases '' leaves the kill out",
    )
    parser.add_argument("--port-base", type=int, default=8000,
                        help="the endpoint's port and the six after it (with --cotenants: each deployment's)")  # fmt: skip
    parser.add_argument(
        "--ready-timeout",
        type=int,
        default=420,
        help="with --cotenants: each deployment's vllm.readyTimeoutSeconds, and how long the lane waits for each",
    )
    parser.add_argument(
        "--cotenants-unpinned", action="store_true", help="as the program rendered co-tenants before: no pin, no turn"
    )
    parser.add_argument(
        "--gpu-memory-mib",
        type=float,
        default=None,
        help="the GPU's size for the memory plan where nvidia-smi cannot say it (the stand-in's GPU), so that the "
        "plan does not follow the memory of the machine the lane runs on",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    if args.cotenants:
        report = run_cotenants(args, sys.modules[__name__])
        print(cotenants_summary(report))
        entries = report["replicas"].values()
        return 0 if all(entry.get("ready") == 0 for entry in entries) and report.get("kill", {}).get(
            "serving_again_seconds", 0) is not None else 1  # fmt: skip
    report = run_lane(args)
    save(report, Path(args.out))
    path = report_path(report, Path(args.out))
    print(summary(report))
    print(f"lane: report {path}")
    ok = all(info["ok"] for info in report["steps"].values()) and "ready" in report["steps"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
