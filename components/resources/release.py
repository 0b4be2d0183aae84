"""A release: what defines the model server's behaviour, and where this stack takes it from.

Either the stack's own `image`/`model`/engine settings, or — with `promoteFrom` — the `release`
output of an earlier stack, which must exist and be validated (its smoke test passed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import pulumi

from components.config import ClusterConfig, ReleaseConfig
from components.plan.engine import EngineSettings
from components.plan.engine import whole as _number
from components.plan.fabric import describe as describe_fabric
from components.plan.shell import fingerprint

REQUIRED_FIELDS = ("image", "validated")  # and a model: the release's own, or each deployment's
BENCHMARK_FIELDS = ("tool", "outputTokensPerSecond", "requestsPerSecond", "ttftMs", "itlMs", "errors", "completed",
                    "durationSeconds", "settings")  # fmt: skip


class ReleaseError(Exception):
    pass


@dataclass(frozen=True)
class ReleaseSource:
    image: pulumi.Output[str]
    model: pulumi.Output[str]
    engine: pulumi.Output[EngineSettings]
    origin: str  # "config" or the promoted-from stack
    # a promoted release with speculation: the answers (and benchmark) without it that its validation kept
    baseline: Optional[pulumi.Output[Optional[dict]]] = None
    # a promoted release: what it recorded of its image's vLLM and the rules it was validated under (vllm_record)
    vllm: Optional[pulumi.Output[Optional[dict]]] = None
    # a promoted release: the hosts it was validated on (components/plan/host.py host_record)
    hosts: Optional[pulumi.Output[Optional[dict]]] = None


def floor_problems(release: dict[str, Any], stack: str, floors: ReleaseConfig | None) -> list[str]:
    """What of `release.*` the release's benchmark misses, each with its figure and the floor."""
    if floors is None:
        return []
    problems = _speculation_floor_problems(release, stack, floors)
    if floors.min_output_tokens_per_second is None and floors.max_p99_ttft_ms is None:
        return problems
    bench = release.get("benchmark")
    if not isinstance(bench, dict) or bench.get("outputTokensPerSecond") is None:
        return problems + [
            f"promoteFrom {stack!r}: its release {release.get('fingerprint', '?')} has no benchmark figures, and this "
            f"stack's release.* floors need them: deploy {stack} with benchmark.enabled: true"
        ]
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


def _speculation_floor_problems(release: dict[str, Any], stack: str, floors: ReleaseConfig) -> list[str]:
    """release.minAcceptanceLength and release.minSpeculativeSpeedup against the release's speculation."""
    wanted = [
        ("minAcceptanceLength", floors.min_acceptance_length, "acceptance", "meanAcceptanceLength",
         "mean acceptance length"),
        ("minSpeculativeSpeedup", floors.min_speculative_speedup, "speedup", None,
         "speed-up over the same load without it"),
    ]  # fmt: skip
    spec = release.get("speculative")
    problems = []
    for key, floor, field, inner, what in wanted:
        if floor is None:
            continue
        if not isinstance(spec, dict):
            problems.append(
                f"promoteFrom {stack!r}: release.{key}: its release {release.get('fingerprint', '?')} runs without "
                "speculative decoding (no vllm.speculative), so it has no such figure"
            )
            continue
        value = spec.get(field)
        value = value.get(inner) if inner and isinstance(value, dict) else value
        if value is None:
            problems.append(
                f"promoteFrom {stack!r}: release.{key}: its release has no {what} (its benchmark did not run, or ran "
                f"without a start to compare with): deploy {stack} with benchmark.enabled: true and smokeTest on"
            )
        elif _number(value) < floor:
            problems.append(
                f"promoteFrom {stack!r}: release.{key}: its release's {what} was {_number(value)}, below the floor "
                f"{_number(floor)} ({spec.get('method')}, {_number(spec.get('tokens'))} tokens)"
            )
    return problems


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


@dataclass(frozen=True)
class Promotion:
    """What a stack asks of the release it promotes: from which stack, the pinned fingerprint
    (promoteFingerprint), whether an image id without a registry will do (imageTransfer.method copy: the copy
    source holds it), and the floors on the release's figures (`release`)."""

    stack: str
    fingerprint: Optional[str] = None
    copies_image: bool = False
    floors: Optional[ReleaseConfig] = None

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Promotion:
        copies = cfg.image_transfer.method == "copy"
        return cls(str(cfg.promote_from), cfg.promote_fingerprint, copies, cfg.release)


def check_promotable(release: Any, asked: Promotion) -> dict[str, Any]:
    """The release of stack `asked.stack`, or ReleaseError saying why it cannot be promoted."""
    stack, fingerprint, copies_image = asked.stack, asked.fingerprint, asked.copies_image
    if not isinstance(release, dict):
        raise ReleaseError(
            f"promoteFrom {stack!r}: that stack has no `release` output (deploy it first, with smokeTest on)"
        )
    missing = [key for key in REQUIRED_FIELDS if release.get(key) in (None, "")]
    if "deployments" not in release and release.get("model") in (None, ""):
        missing.append("model")
    if missing:
        raise ReleaseError(f"promoteFrom {stack!r}: its release lacks {missing}")
    if release["validated"] is not True:
        raise ReleaseError(
            f"promoteFrom {stack!r}: its release {release.get('fingerprint', '?')} is not validated "
            "(its smoke test did not pass or was turned off); refusing to promote it"
        )
    problems = floor_problems(release, stack, asked.floors)
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


def release_source(cfg: ClusterConfig, deployment: str | None = None) -> ReleaseSource:
    """What `cfg` deploys: its own image, model and engine settings, or the promoted stack's release (with
    `deployment`: that release's deployment of this name; `cfg` is then a replica's view)."""
    if deployment is not None and cfg.promote_from is not None:
        return _deployment_source(cfg, deployment)
    if cfg.promote_from is None:
        return ReleaseSource(
            image=pulumi.Output.from_input(cfg.image),
            model=pulumi.Output.from_input(cfg.model),
            engine=pulumi.Output.from_input(EngineSettings.of(cfg)),
            origin="config",
        )
    asked = Promotion.of(cfg)
    stack = asked.stack
    release = (
        pulumi.StackReference(stack)
        .get_output("release")
        .apply(lambda r: _announce(stack, check_promotable(_single_model(r, stack), asked)))
    )
    defaults = EngineSettings.of(cfg)
    return ReleaseSource(
        image=release.apply(lambda r: r["image"]),
        model=release.apply(lambda r: r["model"]),
        engine=release.apply(lambda r: defaults.promoted(r.get("engine") or {})),
        origin=stack,
        baseline=release.apply(kept_baseline),
        vllm=release.apply(lambda r: r.get("vllm")),
        hosts=release.apply(lambda r: r.get("hosts")),
    )


def _single_model(release: Any, stack: str) -> Any:
    if isinstance(release, dict) and "deployments" in release:
        raise ReleaseError(
            f"promoteFrom {stack!r}: its release has deployments ({sorted(release['deployments'])}); this stack "
            "serves one model: give it the same deployments"
        )
    return release


def _deployment_source(cfg: ClusterConfig, deployment: str) -> ReleaseSource:
    asked = Promotion.of(cfg)
    release = (
        pulumi.StackReference(asked.stack)
        .get_output("release")
        .apply(lambda r: check_promotable_deployment(r, asked, deployment))
    )
    defaults = EngineSettings.of(cfg)
    return ReleaseSource(
        image=release.apply(lambda r: r["image"]),
        model=release.apply(lambda r: r["deployments"][deployment]["model"]),
        engine=release.apply(lambda r: defaults.promoted(r["deployments"][deployment].get("engine") or {})),
        origin=asked.stack,
        baseline=release.apply(lambda r: kept_baseline(r["deployments"][deployment])),
        vllm=release.apply(lambda r: r["deployments"][deployment].get("vllm")),
        hosts=release.apply(lambda r: r["deployments"][deployment].get("hosts")),
    )


def kept_baseline(release: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What a release with speculation was validated against (its answers without it), carried on."""
    spec = release.get("speculative")
    return spec.get("baseline") if isinstance(spec, dict) else None


def check_promotable_deployment(release: Any, asked: Promotion, deployment: str) -> dict[str, Any]:
    """The release of stack `asked.stack` with its deployment `deployment`, or ReleaseError saying why it cannot
    be promoted: the stack's release as a whole as check_promotable judges one (image, validated, pinned
    fingerprint), that deployment in it, and the floors on that deployment's benchmark."""
    stack = asked.stack
    if isinstance(release, dict) and "deployments" not in release:
        raise ReleaseError(
            f"promoteFrom {stack!r}: its release is a single-model stack's; this stack has deployments: deploy "
            f"{stack} with the same deployments first"
        )
    whole = check_promotable(release, dataclasses.replace(asked, floors=None))
    found = (whole.get("deployments") or {}).get(deployment)
    if not isinstance(found, dict) or not found.get("model"):
        have = sorted(whole.get("deployments") or {})
        raise ReleaseError(f"promoteFrom {stack!r}: its release has no deployment {deployment!r} (it has {have})")
    problems = floor_problems(found, f"{stack}' deployment '{deployment}", asked.floors)
    if problems:
        raise ReleaseError("\n".join(problems))
    return _announce(stack, whole)


def _announce(stack: str, release: dict[str, Any]) -> dict[str, Any]:
    """Says (in preview and up) which release is promoted and the fabric it was validated on."""
    pulumi.log.info(
        f"promoteFrom {stack!r}: release {release.get('fingerprint')}, validated on the fabric: "
        f"{describe_fabric(release.get('fabric') or {})}; it served: {describe_benchmark(release.get('benchmark'))}"
    )
    return release


def release_record(
    image: str,
    model: str,
    engine: EngineSettings,
    validated: bool,
    origin: str,
    fabric: dict | None = None,
    benchmark: dict | None = None,
    speculation: dict | None = None,
    vllm: dict | None = None,
    hosts: dict | None = None,
) -> dict[str, Any]:
    """What this stack runs and whether it was validated; `fabric`: the fabric gate's figures on this
    stack's nodes, `benchmark`: how fast it served there, with the settings that produced it (what the
    release ran on and did; not part of the fingerprint, which is what it is); `speculation`: with
    vllm.speculative, how its answers compared and what it gained (speculation_record); `vllm`: the image's vLLM and
    the rules the program held it to (components/plan/preflight.py vllm_record); `hosts`: what the nodes it ran on
    run (components/plan/host.py host_record: a promotion compares its own with them)."""
    body = {"image": image, "model": model, "engine": engine.release()}
    record = {**body, "validated": validated, "fingerprint": fingerprint(body), "promotedFrom": origin}
    if fabric is not None:
        record["fabric"] = {key: fabric.get(key) for key in ("checked", "links", "bandwidthGbps", "floorGbps")}
        if fabric.get("nccl"):  # with fabric.bandwidthTest: nccl, the network NCCL used
            record["fabric"]["nccl"] = fabric["nccl"]
    if benchmark:
        record["benchmark"] = {key: benchmark.get(key) for key in BENCHMARK_FIELDS}
        # figures newer than the release format: only where measured, so older records read as they did
        record["benchmark"].update({key: benchmark[key] for key in ("tpotMs", "speculative") if benchmark.get(key)})
    if speculation:
        record["speculative"] = speculation
    if vllm:  # the image's vLLM and the rules it was held to (a promotion holds it to the same: vllm_record)
        record["vllm"] = {key: vllm.get(key) for key in ("version", "heldTo", "rules")}
    if hosts:
        record["hosts"] = hosts
    return record


def speculation_record(
    engine: EngineSettings, validation: dict | None, baseline: dict | None, benchmark: dict | None
) -> dict[str, Any] | None:
    """A release with vllm.speculative: its method and tokens, how its validation's greedy answers agreed
    with those without speculation (`validation`), what they were held against (`baseline`: kept for the
    next stack's validation), the acceptance vLLM counted in its benchmark, and the speed-up over the
    same load without speculation (the baseline's benchmark). None for a release without it."""
    spec = engine.speculative
    if spec is None:
        return None
    record: dict[str, Any] = {"method": spec.method, "tokens": spec.tokens}
    if validation:
        record["answers"] = validation
    if baseline:
        record["baseline"] = baseline
    accepted = (benchmark or {}).get("speculative")
    if accepted:
        record["acceptance"] = {
            "rate": accepted.get("acceptanceRate"),
            "meanAcceptanceLength": accepted.get("meanAcceptanceLength"),
            "perPosition": accepted.get("acceptedPerPosition"),
        }
    without = (baseline or {}).get("benchmark") or {}
    if benchmark and without.get("outputTokensPerSecond") and benchmark.get("outputTokensPerSecond") is not None:
        record["speedup"] = round(benchmark["outputTokensPerSecond"] / without["outputTokensPerSecond"], 3)
        record["withoutSpeculation"] = {
            "outputTokensPerSecond": without.get("outputTokensPerSecond"),
            "tpotMs": without.get("tpotMs"),
        }
        record["withSpeculation"] = {
            "outputTokensPerSecond": benchmark.get("outputTokensPerSecond"),
            "tpotMs": benchmark.get("tpotMs"),
        }
    return record


def stack_release_record(deployments: dict[str, dict[str, Any]], fabric: dict | None = None) -> dict[str, Any]:
    """With deployments: the stack's release, each deployment's record in it (its model, engine settings,
    whether it was validated, its benchmark), the image they share, validated when every one is; the
    fingerprint covers every deployment's."""
    images = sorted({record["image"] for record in deployments.values()})
    body = {"image": images[0] if len(images) == 1 else images, "deployments": {
        name: {key: record[key] for key in ("model", "engine")} for name, record in sorted(deployments.items())
    }}  # fmt: skip
    record: dict[str, Any] = {
        **body,
        "validated": all(each.get("validated") is True for each in deployments.values()),
        "fingerprint": fingerprint(body),
        "promotedFrom": sorted({each.get("promotedFrom") for each in deployments.values()})[0],
    }
    record["deployments"] = {
        name: {key: value for key, value in each.items() if key != "image"}
        for name, each in sorted(deployments.items())
    }
    if fabric is not None:
        record["fabric"] = {key: fabric.get(key) for key in ("checked", "links", "bandwidthGbps", "floorGbps")}
    return record
