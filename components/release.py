"""A release: what defines the model server's behaviour, and where this stack takes it from.

Either the stack's own `image`/`model`/engine settings, or — with `promoteFrom` — the `release`
output of an earlier stack, which must exist and be validated (its smoke test passed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi

from components.config import ClusterConfig, ReleaseConfig
from components.fabric import describe as describe_fabric
from components.render import engine_settings, fingerprint

REQUIRED_FIELDS = ("image", "model", "validated")
BENCHMARK_FIELDS = ("tool", "outputTokensPerSecond", "requestsPerSecond", "ttftMs", "itlMs", "errors", "completed",
                    "durationSeconds", "settings")  # fmt: skip


class ReleaseError(Exception):
    pass


@dataclass(frozen=True)
class ReleaseSource:
    image: pulumi.Output[str]
    model: pulumi.Output[str]
    engine: pulumi.Output[dict]
    origin: str  # "config" or the promoted-from stack


def floor_problems(release: dict[str, Any], stack: str, floors: ReleaseConfig | None) -> list[str]:
    """What of `release.*` the release's benchmark misses, each with its figure and the floor."""
    if floors is None or (floors.min_output_tokens_per_second is None and floors.max_p99_ttft_ms is None):
        return []
    bench = release.get("benchmark")
    if not isinstance(bench, dict) or bench.get("outputTokensPerSecond") is None:
        return [
            f"promoteFrom {stack!r}: its release {release.get('fingerprint', '?')} has no benchmark figures, and this "
            f"stack's release.* floors need them: deploy {stack} with benchmark.enabled: true"
        ]
    problems = []
    settings = describe_benchmark(bench)
    # whole figures as whole numbers (180.0 comes back from state as 180): the message says what was measured
    rate, floor = _number(bench["outputTokensPerSecond"]), floors.min_output_tokens_per_second
    if floor is not None and rate < floor:
        problems.append(
            f"promoteFrom {stack!r}: release.minOutputTokensPerSecond: its release made {rate} output tokens/s, "
            f"below the floor {floor} ({settings})"
        )
    ttft, ceiling = _number((bench.get("ttftMs") or {}).get("p99")), floors.max_p99_ttft_ms
    if ceiling is not None and (ttft is None or ttft > ceiling):
        problems.append(
            f"promoteFrom {stack!r}: release.maxP99TtftMs: its release's p99 time to first token was {ttft} ms, "
            f"above the ceiling {ceiling} ms ({settings})"
        )
    return problems


def _number(value: Any) -> Any:
    """A figure as it was measured: whole numbers come back from state as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else value


def describe_benchmark(bench: dict[str, Any] | None) -> str:
    """One line: the figures and the load that produced them."""
    if not bench:
        return "no benchmark"
    s = {key: _number(value) for key, value in (bench.get("settings") or {}).items()}
    ttft = {key: _number(value) for key, value in (bench.get("ttftMs") or {}).items()}
    itl = {key: _number(value) for key, value in (bench.get("itlMs") or {}).items()}
    return (
        f"{_number(bench.get('outputTokensPerSecond'))} output tokens/s, {_number(bench.get('requestsPerSecond'))} "
        "requests/s, "
        f"TTFT p50 {ttft.get('p50')} / p99 {ttft.get('p99')} ms, ITL p50 {itl.get('p50')} / p99 {itl.get('p99')} ms, "
        f"{_number(bench.get('errors'))} error(s); {bench.get('tool')}: {s.get('requests')} requests, concurrency "
        f"{s.get('concurrency')}, {s.get('promptTokens')} prompt + {s.get('outputTokens')} output tokens"
    )


def check_promotable(
    release: Any,
    stack: str,
    fingerprint: str | None = None,
    copies_image: bool = False,
    floors: ReleaseConfig | None = None,
) -> dict[str, Any]:
    """The release of stack `stack`, or ReleaseError saying why it cannot be promoted."""
    if not isinstance(release, dict):
        raise ReleaseError(
            f"promoteFrom {stack!r}: that stack has no `release` output (deploy it first, with smokeTest on)"
        )
    missing = [key for key in REQUIRED_FIELDS if release.get(key) in (None, "")]
    if missing:
        raise ReleaseError(f"promoteFrom {stack!r}: its release lacks {missing}")
    if release["validated"] is not True:
        raise ReleaseError(
            f"promoteFrom {stack!r}: its release {release.get('fingerprint', '?')} is not validated "
            "(its smoke test did not pass or was turned off); refusing to promote it"
        )
    problems = floor_problems(release, stack, floors)
    if problems:
        raise ReleaseError("\n".join(problems))
    if fingerprint is not None and release.get("fingerprint") != fingerprint:
        raise ReleaseError(
            f"promoteFrom {stack!r}: its release is now {release.get('fingerprint')}, not the pinned "
            f"promoteFingerprint {fingerprint}; review the new release and update promoteFingerprint"
        )
    image = release["image"]
    if image.startswith("sha256:") and copies_image:
        return release  # the copy source must hold that id; every other node receives it from there
    if image.startswith("sha256:"):
        # An image id without a repository: it was built or loaded on that stack's nodes and no
        # registry holds it, so no node here could pull it.
        raise ReleaseError(
            f"promoteFrom {stack!r}: its release image {image} has no registry digest (it was built or loaded "
            "locally on that stack's nodes, so no node of this stack could pull it): push it to a registry and "
            f"deploy {stack} with image: <name>@sha256:<digest>; or set imageTransfer.method: copy here and load "
            "the image on this stack's copy source"
        )
    if "@sha256:" not in image:
        raise ReleaseError(f"promoteFrom {stack!r}: release image {image!r} is not pinned by digest")
    return release


def release_source(cfg: ClusterConfig) -> ReleaseSource:
    if cfg.promote_from is None:
        return ReleaseSource(
            image=pulumi.Output.from_input(cfg.image),
            model=pulumi.Output.from_input(cfg.model),
            engine=pulumi.Output.from_input(engine_settings(cfg)),
            origin="config",
        )
    stack = cfg.promote_from
    pinned = cfg.promote_fingerprint
    copies = cfg.image_transfer.method == "copy"
    release = (
        pulumi.StackReference(stack)
        .get_output("release")
        .apply(lambda r: _announce(stack, check_promotable(r, stack, pinned, copies, cfg.release)))
    )
    defaults = engine_settings(cfg)
    return ReleaseSource(
        image=release.apply(lambda r: r["image"]),
        model=release.apply(lambda r: r["model"]),
        engine=release.apply(lambda r: _engine(defaults, r.get("engine") or {})),
        origin=stack,
    )


def _announce(stack: str, release: dict[str, Any]) -> dict[str, Any]:
    """Says (in preview and up) which release is promoted and the fabric it was validated on."""
    pulumi.log.info(
        f"promoteFrom {stack!r}: release {release.get('fingerprint')}, validated on the fabric: "
        f"{describe_fabric(release.get('fabric') or {})}; it served: {describe_benchmark(release.get('benchmark'))}"
    )
    return release


def _engine(defaults: dict[str, Any], promoted: dict[str, Any]) -> dict[str, Any]:
    """The promoted engine settings over this stack's; numbers come back from state as floats."""
    engine = {**defaults, **promoted}
    if isinstance(engine.get("maxModelLen"), float) and engine["maxModelLen"].is_integer():
        engine["maxModelLen"] = int(engine["maxModelLen"])
    return engine


def release_record(
    image: str,
    model: str,
    engine: dict,
    validated: bool,
    origin: str,
    fabric: dict | None = None,
    benchmark: dict | None = None,
) -> dict[str, Any]:
    """What this stack runs and whether it was validated; `fabric`: the fabric gate's figures on this
    stack's nodes, `benchmark`: how fast it served there, with the settings that produced it (what the
    release ran on and did; not part of the fingerprint, which is what it is)."""
    body = {"image": image, "model": model, "engine": engine}
    record = {**body, "validated": validated, "fingerprint": fingerprint(body), "promotedFrom": origin}
    if fabric is not None:
        record["fabric"] = {key: fabric.get(key) for key in ("checked", "links", "bandwidthGbps", "floorGbps")}
        if fabric.get("nccl"):  # with fabric.bandwidthTest: nccl, the network NCCL used
            record["fabric"]["nccl"] = fabric["nccl"]
    if benchmark:
        record["benchmark"] = {key: benchmark.get(key) for key in BENCHMARK_FIELDS}
    return record
