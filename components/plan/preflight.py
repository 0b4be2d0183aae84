"""Checks before anything is deployed: the remote commands and how their answers are judged.

Pure functions, no Pulumi and no I/O: `components/scripts/preflight_node.sh` and
`components/scripts/model_fingerprint.py` run on the node hosts; what they print is judged here.
"""

from __future__ import annotations

from typing import Any, Optional

from components.config import ClusterConfig, NodeConfig
from components.config.vllm_args import read_extra_args
from components.config.vllm_versions import NEWEST_READ, VllmRules, parse, rules, support
from components.plan.container import container_name
from components.plan.engine import EngineSettings
from components.plan.memory import GIB, MIB, NodeMemory, Plan, engine_knobs, model_shape, plan_memory
from components.plan.programs import last_json
from components.scripts.node_contract import ImageFacts, ModelFingerprint, NodeMemoryFacts

MAX_DIFFERENCES = 5


def model_path(model: str | None) -> str:
    """The model's host path, or "" when the model is a Hugging Face repo id (or not set)."""
    return model if model and model.startswith("/") else ""


def preflight_argv(cfg: ClusterConfig, node: NodeConfig, model: str | None) -> list[str]:
    """`env … bash -s` running components/scripts/preflight_node.sh (fed on stdin) on `node`'s host.

    Peers go as NAME=ADDRESS so a failure names both nodes of the pair.
    """
    peers = " ".join(f"{peer.name}={peer.fabric_address}" for peer in cfg.nodes if peer.name != node.name)
    return [
        "env",
        f"NODE={node.name}",
        f"FABRIC_IF={node.fabric_interface}",
        f"FABRIC_ADDR={node.fabric_address}",
        f"PEERS={peers}",
        f"MODEL={model_path(model)}",
        f"CONTAINER={container_name(cfg, node)}",
        f"FABRIC_CHECKS={0 if cfg.fabric.gate != 'off' else 1}",  # the fabric gate checks the link, in full
        "bash",
        "-s",
    ]


def fingerprint_argv(model_dir: str) -> list[str]:
    """`python3 - MODEL_DIR`: runs components/scripts/model_fingerprint.py (fed on stdin) on a host."""
    return ["python3", "-", model_dir]


def parse_fingerprint(stdout: str) -> ModelFingerprint:
    """What model_fingerprint.py printed; a fingerprint with `error` when it printed nothing the contract reads."""
    try:
        return ModelFingerprint.from_json(last_json(stdout))
    except (ValueError, TypeError) as error:
        return ModelFingerprint(error=f"{error}: {stdout.strip()[-200:]!r}")


def _differences(node: str, reference: str, mine: ModelFingerprint, theirs: ModelFingerprint) -> list[str]:
    """What differs between `mine` (node) and `theirs` (reference), sorted by path."""
    files, ref_files = mine.files, theirs.files
    meta, ref_meta = mine.metadata, theirs.metadata
    found = []
    for path in sorted(set(files) | set(ref_files)):
        if path not in files:
            found.append(f"missing on {node}: {path}")
        elif path not in ref_files:
            found.append(f"missing on {reference}: {path}")
        elif files[path] != ref_files[path]:
            found.append(f"{path} size {files[path]} vs {ref_files[path]}")
        elif meta.get(path) != ref_meta.get(path):
            found.append(f"{path} hash differs")
    for path in sorted(set(mine.broken) - set(theirs.broken)):
        found.append(f"broken symlink on {node}: {path}")
    for path in sorted(set(theirs.broken) - set(mine.broken)):
        found.append(f"broken symlink on {reference}: {path}")
    return found


def compare_fingerprints(by_node: dict[str, ModelFingerprint]) -> list[str]:
    """Problems when the model is not the same on every node; [] when it is.

    `by_node` maps node name to what model_fingerprint.py printed (parsed), the head first: every
    other node is compared with the first. An entry with an `error` reports that node's failure.
    Each problem names the two nodes and the first differing files, e.g.
    `model differs: node-2 vs node-1: config.json hash differs; model-00001.safetensors size 123 vs 456`.
    """
    problems = []
    valid = {}
    for node, result in by_node.items():
        if result.error is not None or result.fingerprint is None:
            problems.append(f"model fingerprint failed on {node}: {result.error or 'no fingerprint'}")
        else:
            valid[node] = result
    if not valid:
        return problems
    reference, *others = valid
    for node in others:
        if valid[node].fingerprint == valid[reference].fingerprint:
            continue
        found = _differences(node, reference, valid[node], valid[reference]) or ["fingerprint differs"]
        shown = found[:MAX_DIFFERENCES]
        if len(found) > MAX_DIFFERENCES:
            shown.append(f"… and {len(found) - MAX_DIFFERENCES} more")
        problems.append(f"model differs: {node} vs {reference}: " + "; ".join(shown))
    return problems


def image_check_argv(image_id: str) -> list[str]:
    """`docker run --rm -i … python3 -` of components/scripts/image_probe.py (fed on stdin) in `image_id`."""
    return ["docker", "run", "--rm", "-i", "--network=none", "--entrypoint", "python3", image_id, "-"]


def _release(version: str | None) -> tuple[int, ...]:
    parts = []
    for part in (version or "").split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


RAY_AUTH_SINCE = (2, 52)  # RAY_AUTH_MODE=token (older Ray ignores it and runs without authentication)


def image_problems(cfg: ClusterConfig, node: NodeConfig, stdout: str) -> list[str]:
    """What the image on `node` lacks for this config (image_probe.py's facts), one line each with the fix."""
    try:
        facts = ImageFacts.from_json(last_json(stdout))
    except (ValueError, TypeError):
        return [f"image check {node.name}: the image's python3 said nothing readable ({stdout.strip()[:200]!r})"]
    where = f"image check {node.name}"
    problems = []
    refused = support(facts.vllm).problem() if facts.vllm else None
    if not facts.vllm:
        problems.append(f"{where}: the image has no vLLM (no `vllm` package or command) — set image to a vLLM image")
    elif refused:
        problems.append(f"{where}: {refused}")
    elif cfg.executor == "mp" and len(cfg.nodes) > 1 and facts.vllm_nnodes is False:  # (a refused vLLM: no more)
        problems.append(
            f"{where}: executor mp needs vLLM's multi-node flags (--nnodes, --node-rank, --headless), and the image's "
            f"vLLM {facts.vllm} has none — use executor: ray, or an image with a newer vLLM"
        )
    if facts.vllm and not refused and facts.vllm_load_tracking is False:
        problems.append(
            f"{where}: the image's vLLM {facts.vllm} has no --enable-server-load-tracking, which every vLLM of this "
            "program is started with (its /load counts the requests a stuck engine never saw: docs/recovery.md) — use "
            "an image with vLLM 0.8 or later"
        )
    if cfg.executor == "ray":
        ray = facts.ray
        if not ray:
            chosen = f" ({cfg.executor_reason})" if cfg.executor_reason else ""
            problems.append(
                f"{where}: the image has no Ray{chosen} — set executor: mp, or use an image with Ray installed"
            )
        else:
            if cfg.ray.auth == "token" and _release(ray)[:2] < RAY_AUTH_SINCE:
                problems.append(
                    f"{where}: ray.auth: token needs Ray 2.52 or later and the image has Ray {ray}, which ignores "
                    "RAY_AUTH_MODE and would run without authentication — set ray.auth: none (with network.guard: "
                    "true), or use an image with Ray 2.52 or later"
                )
            if cfg.ray.dashboard and facts.ray_dashboard is False:
                problems.append(
                    f"{where}: ray.dashboard: true needs Ray's dashboard packages (ray[default]) and the image lacks "
                    f"them ({facts.ray_dashboard_error or 'not importable'}): `ray start` would stop with "
                    "'Cannot include dashboard with missing packages.' — set ray.dashboard: false, or use an image "
                    "with ray[default]"
                )
    return problems


class VllmRulesChangedError(Exception):
    """A promoted release was validated under other rules for its vLLM than this program holds it to now."""


class VllmRefusesError(Exception):
    """The image's vLLM would refuse the engine settings at start (a choice its parser no longer takes)."""


def vllm_refusals(held: VllmRules, extra_args: list[str], key: str = "vllm") -> list[str]:
    """What in `extra_args` the vLLM the image holds refuses at start, one line each, naming the key."""
    mode = read_extra_args(list(extra_args)).value_of("--mamba-cache-mode", list(extra_args))
    if mode is not None and mode not in held.mamba_cache_modes:
        return [
            f"{key}.extraArgs: --mamba-cache-mode {mode} — one of {', '.join(held.mamba_cache_modes)}: the image's "
            f"vLLM {held.label} refuses {mode!r} at start (config/cache.py MambaCacheMode); prefix caching decides "
            "the mode from 0.34 (--enable-prefix-caching / --no-enable-prefix-caching)"
        ]
    return []


def vllm_record(stdout: str, validated: Optional[dict], origin: str) -> dict[str, Any]:
    """What the release records of the image's vLLM (image_probe.py's facts, read through vllm_versions): the
    version it says, the verdict, the rules the program held it to and their fingerprint, whether it has
    --enable-scale-out. `validated`: a promoted release's own record, whose rules must be these
    (VllmRulesChangedError)."""
    try:
        facts = ImageFacts.from_json(last_json(stdout))
    except (ValueError, TypeError):
        facts = ImageFacts()
    found = support(facts.vllm)
    held = found.rules
    record = {
        "version": facts.vllm,
        "verdict": found.verdict,
        "heldTo": held.label,
        "rules": held.fingerprint(),
        "scaleOut": facts.vllm_scale_out,
    }
    if isinstance(validated, dict) and validated.get("rules") and validated["rules"] != record["rules"]:
        differ = ", ".join(changed_rules(validated.get("heldTo"), held)) or "its defaults"
        raise VllmRulesChangedError(
            f"promoteFrom {origin!r}: its release was validated under this program's rules for vLLM "
            f"{validated.get('version')} as they were then ({validated['rules']}); this program reads that vLLM "
            f"otherwise now ({record['rules']}: {differ}): deploy {origin} with this program first, so that it "
            "validates the release again"
        )
    return record


def changed_rules(before: Optional[str], now: VllmRules) -> list[str]:
    """The rules in which `now` differs from the rules of the version `before` (a label) as read today."""
    version = parse(before)
    if version is None:
        return []
    then = rules(version)
    return [
        name for name in now.__dataclass_fields__ if name != "version" and getattr(then, name) != getattr(now, name)
    ]


def held_to(record: Optional[dict]) -> VllmRules:
    """The rules vllm_record said the image's vLLM is held to (the newest read where it said none)."""
    version = parse((record or {}).get("heldTo"))
    return rules(version if version is not None else NEWEST_READ)


def image_warnings(node: NodeConfig, stdout: str) -> list[str]:
    """What in the image on `node` the program could not check, or costs time without stopping anything
    (image_probe.py's facts): a vLLM newer than any whose rules were read (vllm_versions.support), vLLM or
    torch without bytecode in an image that runs Python with PYTHONDONTWRITEBYTECODE, so that each of
    vLLM's processes compiles their sources again at every start and restart."""
    try:
        facts = ImageFacts.from_json(last_json(stdout))
    except (ValueError, TypeError):
        return []  # image_problems reports it
    unread = support(facts.vllm).warning() if facts.vllm else None
    found = [f"image check {node.name}: {unread}"] if unread else []
    missing = [name for name, compiled in facts.bytecode.items() if compiled is False]
    if not missing or not facts.dont_write_bytecode:
        return found  # without PYTHONDONTWRITEBYTECODE the first start writes the bytecode in the container
    verb = "has" if len(missing) == 1 else "have"
    return found + [
        f"image check {node.name}: {' and '.join(sorted(missing))} in the image {verb} no bytecode and the image runs "
        "Python with PYTHONDONTWRITEBYTECODE=1, so each of vLLM's processes compiles them again at every start and "
        "restart (on an H200 `import torch` took 4.6 s instead of 1.4 s, and a Ray recovery 98–104 s instead of "
        "71–76 s) — compile them in the image: `RUN python3 -m compileall -q $(python3 -c 'import site; "
        "print(*site.getsitepackages())')` in its Dockerfile"
    ]


def node_memory(node: NodeConfig, stdout: str) -> NodeMemory:
    """The node's memory per GPU from the preflight's last line (see preflight_node.sh): the GPUs' own
    memory where nvidia-smi reports it, else the system memory the GPU shares (GB10), split over its GPUs."""
    facts = NodeMemoryFacts.from_json(last_json(stdout))

    def mib(values: list) -> list[float]:
        return [float(v) for v in values if str(v).replace(".", "", 1).isdigit()]

    # What is free now, for vLLM's start-up check; not judged while this stack's own vLLM holds it.
    judged = not facts.stack_running
    gpu_mib, free_mib = mib(facts.gpu_memory_mib), mib(facts.gpu_free_mib)
    if gpu_mib:
        free = int(min(free_mib) * MIB) if free_mib and judged else None
        return NodeMemory(node.name, node.gpus, int(min(gpu_mib) * MIB), unified=False, free_bytes=free)
    available = facts.mem_available_bytes
    free = int(available) // node.gpus if available is not None and judged else None
    return NodeMemory(node.name, node.gpus, int(facts.mem_total_bytes) // node.gpus, True, free)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def weight_bytes(fingerprint: ModelFingerprint) -> int:
    """The size of the weight files vLLM loads (the fingerprint's "weights": safetensors when there are
    any, else .bin, never original/; components/scripts/vllm_weights.py), or of every weight file when
    the fingerprint predates that list."""
    files = fingerprint.files
    if fingerprint.weights is not None:
        return sum(files.get(path, 0) for path in fingerprint.weights)
    return sum(size for path, size in files.items() if path.lower().endswith(WEIGHT_SUFFIXES))


def memory_plan(
    cfg: ClusterConfig,
    fingerprint_stdout: str,
    memories: list[NodeMemory],
    engine: EngineSettings,
    pin_kv_cache: bool = False,
    vllm: Optional[VllmRules] = None,
) -> Plan:
    """The memory plan for this stack from what the nodes reported: the model's weight sizes and
    config.json (its fingerprint on the head), each node's memory, the engine settings in force, and `vllm`: the
    rules of the image's vLLM (its defaults; the oldest supported where not given)."""
    fingerprint = parse_fingerprint(fingerprint_stdout)
    knobs = engine_knobs(list(engine.extra_args), engine.speculative, vllm)
    shape = model_shape(fingerprint.config, knobs=knobs)
    return plan_memory(
        memories,
        weight_bytes(fingerprint),
        shape,
        cfg.tensor_parallel_size,
        cfg.pipeline_parallel_size,
        engine.max_model_len,
        cfg.vllm.gpu_memory_utilization,
        int(cfg.memory.os_reserve_gib * GIB),
        knobs=knobs,
        max_num_seqs=cfg.vllm.max_num_seqs if isinstance(cfg.vllm.max_num_seqs, int) else None,
        pin_kv_cache=pin_kv_cache,
    )
