"""Where the rehearsal keeps what it builds between runs (the image archive, Debian's packages unpacked: HAProxy,
Prometheus), keyed by what goes into each. A module of its own: the GPU lane's edge (tests/edge_harness.py) finds
HAProxy there without importing the rehearsal, which needs the Pulumi SDK the GPU machine has not."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("SPARK_VLLM_REHEARSAL_CACHE", "/var/tmp/spark-vllm-rehearsal"))
