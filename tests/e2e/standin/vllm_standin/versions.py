"""Which vLLM the stand-in plays, and what it does differently for that release: its flags, which routes its key
guards, the render routes vllm-router's cache_aware asks for, its defaults and log lines. Each rule is vLLM's own,
read in the release wheels (0.25.0 … 0.34.0, 2026-12-06; paths under vllm/ of the release named). The program
holds the same facts from its side (components/config/vllm_versions.py); tests/e2e/standin/test_vllm_standin.py
holds the two to each other.

The release played: VLLM_STANDIN_PLAYS in the environment, else the file PLAYS beside this module (the
rehearsal's image for a release bakes it in: tests/e2e/image/build.py publish_played), else 0.25.0.

Pure standard library.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT = "0.25.0"
PLAYABLE = ("0.25.0", "0.34.0")  # the releases the rehearsal plays (every rule below covers 0.25 to 0.34)


def played() -> str:
    given = os.environ.get("VLLM_STANDIN_PLAYS", "").strip()
    if given:
        return given
    try:
        return (Path(__file__).with_name("PLAYS").read_text().strip()) or DEFAULT
    except OSError:
        return DEFAULT


def _minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if not found:
        raise ValueError(f"VLLM_STANDIN_PLAYS={version!r}: a vLLM release such as 0.34.0")
    return int(found.group(1)), int(found.group(2))


@dataclass(frozen=True)
class Played:
    version: str

    @property
    def minor(self) -> tuple[int, int]:
        return _minor(self.version)

    @property
    def disable_switches(self) -> bool:
        """`--disable-X` beside `--enable-X` (utils/argparse_utils.py:120-146 EnableDisableAction, 0.33 on)."""
        return self.minor >= (0, 33)

    @property
    def gpu_memory_aliases(self) -> tuple[str, ...]:
        """engine/arg_utils.py: --device-memory-utilization names --gpu-memory-utilization from 0.31."""
        return ("--device-memory-utilization",) if self.minor >= (0, 31) else ()

    @property
    def scale_out_flag(self) -> bool:
        """--enable-scale-out exists (entrypoints/scale_out/factories.py, 0.30 on)."""
        return self.minor >= (0, 30)

    def render_refusal(self, enabled: bool) -> int | None:
        """What /v1/chat/completions/render answers instead of rendering: None (it renders: before 0.30, or with
        --enable-scale-out), 404 (0.30-0.31: not mounted), 403 (0.32 on: a route that says to restart with it)."""
        if not self.scale_out_flag or enabled:
            return None
        return 403 if self.minor >= (0, 32) else 404

    @property
    def guarded_prefixes(self) -> tuple[str, ...]:
        """What --api-key guards (entrypoints/serve/utils/server_utils.py GUARDED_PREFIX; /cohere from 0.27;
        0.30 on in serve/middleware/authenticate.py)."""
        base = ("/v1", "/v2", "/inference")
        return (*base, "/cohere") if self.minor >= (0, 27) else base

    @property
    def keyless_routes_added(self) -> tuple[str, ...]:
        """GET /kv_event_sources (entrypoints/serve/instrumentator/basic.py:59, 0.31 on), without the key."""
        return ("/kv_event_sources",) if self.minor >= (0, 31) else ()

    @property
    def default_block_tokens(self) -> int:
        """config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE: 16, 64 from 0.34."""
        return 64 if self.minor >= (0, 34) else 16

    @property
    def loading_line(self) -> str:
        """The line vLLM logs as it starts loading weights: v1/worker/gpu_model_runner.py's 'Starting to load model
        %s...' up to 0.33; 0.34 has only v1/worker/gpu/model_runner.py:412 'Loading model from scratch...'."""
        return "Loading model from scratch..." if self.minor >= (0, 34) else "Starting to load model %s..."


def plays() -> Played:
    return Played(played())
