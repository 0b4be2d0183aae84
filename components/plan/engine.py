"""A release's engine settings: what changes what the model answers, promoted as a whole. Pure, typed once.

The program reads them as `EngineSettings` (frozen); a release keeps them as a camelCase record (the `engine` of
the `release` output, and what its fingerprint covers), which comes back from another stack's state with whole
numbers as floats. `release()` and `from_release()` are the one way between the two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Optional

# The record's keys, as releases have always spelled them (a release's fingerprint hashes this record).
RECORD_KEYS = {
    "max_model_len": "maxModelLen",
    "trust_remote_code": "trustRemoteCode",
    "reasoning_parser": "reasoningParser",
    "tool_call_parser": "toolCallParser",
    "enable_auto_tool_choice": "enableAutoToolChoice",
    "extra_args": "extraArgs",
}
# vllm.speculative's record keys and the names vLLM 0.25's --speculative-config takes (vllm/config/speculative.py)
SPECULATIVE_KEYS = {
    "method": ("method", "method"),
    "tokens": ("tokens", "num_speculative_tokens"),
    "prompt_lookup_min": ("promptLookupMin", "prompt_lookup_min"),
    "prompt_lookup_max": ("promptLookupMax", "prompt_lookup_max"),
}


def whole(value: Any) -> Any:
    """A number as it was set or measured: whole numbers come back from state as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else value


@dataclass(frozen=True)
class Speculation:
    """vllm.speculative as a release holds it."""

    method: str
    tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None

    def release(self) -> dict[str, Any]:
        """The record (camelCase, unset keys left out)."""
        return {
            record: getattr(self, field)
            for field, (record, _) in SPECULATIVE_KEYS.items()
            if getattr(self, field) is not None
        }

    @classmethod
    def from_release(cls, record: dict[str, Any]) -> Speculation:
        return cls(**{field: whole(record.get(key)) for field, (key, _) in SPECULATIVE_KEYS.items()})

    def flag_value(self) -> str:
        """`--speculative-config`'s JSON: compact, one argv element (the supervisor execs argv as a list)."""
        body = {vllm: getattr(self, field) for field, (_, vllm) in SPECULATIVE_KEYS.items()}
        return json.dumps({k: v for k, v in body.items() if v is not None}, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class EngineSettings:
    max_model_len: Optional[int] = None
    trust_remote_code: bool = False
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    extra_args: tuple[str, ...] = ()
    speculative: Optional[Speculation] = None

    @classmethod
    def of(cls, cfg: Any) -> EngineSettings:
        """A stack's own settings (a ClusterConfig, or a replica's view of one)."""
        spec = cfg.vllm.speculative
        return cls(
            max_model_len=cfg.max_model_len,
            trust_remote_code=cfg.vllm.trust_remote_code,
            reasoning_parser=cfg.vllm.reasoning_parser,
            tool_call_parser=cfg.vllm.tool_call_parser,
            enable_auto_tool_choice=cfg.vllm.enable_auto_tool_choice,
            extra_args=tuple(cfg.vllm.extra_args),
            speculative=None if spec is None else Speculation(
                spec.method, spec.tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            ),
        )  # fmt: skip

    def release(self) -> dict[str, Any]:
        """The record a release keeps. Speculation only when on: every release without it keeps its record, and so
        its fingerprint, as before speculation existed."""
        record: dict[str, Any] = {key: getattr(self, field) for field, key in RECORD_KEYS.items()}
        record["extraArgs"] = list(self.extra_args)
        if self.speculative is not None:
            record["speculative"] = self.speculative.release()
        return record

    @classmethod
    def from_release(cls, record: dict[str, Any]) -> EngineSettings:
        spec = record.get("speculative")
        given = {field: whole(record[key]) for field, key in RECORD_KEYS.items() if key in record}
        given.pop("extra_args", None)
        return cls(
            **given,
            extra_args=tuple(record.get("extraArgs") or ()),
            speculative=Speculation.from_release(spec) if isinstance(spec, dict) and spec else None,
        )

    def promoted(self, record: dict[str, Any]) -> EngineSettings:
        """A promoted release's settings over this stack's: a key the record lacks keeps this stack's value, but
        speculation is the release's alone (a release validated without it is deployed without it)."""
        mine = self.release()
        mine.pop("speculative", None)
        return EngineSettings.from_release({**mine, **record})

    def without_speculation(self) -> EngineSettings:
        return replace(self, speculative=None)
