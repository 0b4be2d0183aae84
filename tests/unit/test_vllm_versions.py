"""The vLLM versions the program drives (components/plan/vllm_versions.py): what a version string says, which
verdict an image's vLLM gets, and each version's rules as read in its release (a table: version → rule → value)."""

from __future__ import annotations

import pytest

from components.config import vllm_versions
from components.config.vllm_versions import CHANGES, NEWEST_READ, OLDEST, parse, rules, support


@pytest.mark.parametrize(
    ("said", "version"),
    [("0.34.0", (0, 34, 0)), ("0.25.0+cu130", (0, 25, 0)), ("0.31.0+nv26.10", (0, 31, 0)), ("v0.27.1", (0, 27, 1)),
     ("0.35.0.dev12+g1234abc", (0, 35, 0)), ("0.34.0rc1", (0, 34, 0)), ("1.0", (1, 0, 0)), ("nightly", None),
     ("", None), (None, None)],
)  # fmt: skip
def test_a_version_is_read_as_vllm_and_pip_write_it(said, version):
    assert parse(said) == version


@pytest.mark.parametrize(
    ("said", "verdict"),
    [("0.24.1", "refused"), ("0.20.1+nv26.05", "refused"), ("0.17.0", "refused"), ("0.25.0", "read"),
     ("0.25.0.dev3", "read"), ("0.31.0+nv26.10", "read"), ("0.34.0", "read"), ("0.34.2", "read"),
     ("0.35.0.dev12+g1", "unread"), ("0.40.0", "unread"), ("1.0.0", "unread"), ("unknown", "unknown")],
)  # fmt: skip
def test_each_vllm_gets_a_verdict_refused_only_below_the_oldest_read(said, verdict):
    found = support(said)
    assert found.verdict == verdict
    assert (found.problem() is not None) == (verdict == "refused")
    assert (found.warning() is not None) == (verdict in ("unread", "unknown"))
    if verdict == "refused":
        assert said in found.problem() and "0.25.0" in found.problem() and "0.34.0" in found.problem()
    if verdict == "unread":
        assert found.rules.default_block_tokens == rules(NEWEST_READ).default_block_tokens  # the newest rules read


# Each version's rules, as read in its wheel (2026-12-06): the table the program holds vLLM to.
TABLE = {
    (0, 25, 0): {"load_tracking_file": "entrypoints/openai/cli_args.py", "disable_switches": False,
                 "gpu_memory_aliases": (), "default_block_tokens": 16, "hybrid_prefix_caching": False,
                 "align_checkpoint_blocks": 0, "unified_small_tier": False, "scale_out_flag": None,
                 "guarded_prefixes": ("/v1", "/v2", "/inference")},
    (0, 26, 0): {"hybrid_prefix_caching": True, "guarded_prefixes": ("/v1", "/v2", "/inference")},
    (0, 27, 1): {"guarded_prefixes": ("/v1", "/v2", "/inference", "/cohere")},
    (0, 29, 0): {"load_tracking_file": "entrypoints/launchers/cli_args.py", "scale_out_flag": None},
    (0, 30, 0): {"scale_out_flag": "--enable-scale-out", "gpu_memory_aliases": (), "keyless_routes_added": ()},
    (0, 31, 0): {"gpu_memory_aliases": ("--device-memory-utilization",), "keyless_routes_added": ("/kv_event_sources",),
                 "disable_switches": False},
    (0, 33, 0): {"load_tracking_file": "entrypoints/common/cli_args.py", "disable_switches": True,
                 "unified_small_tier": True, "align_checkpoint_blocks": 1, "default_block_tokens": 16,
                 "loading_lines": ("Starting to load model", "Loading model from scratch")},
    (0, 34, 0): {"default_block_tokens": 64, "loading_lines": ("Loading model from scratch",),
                 "disable_switches": True, "hybrid_prefix_caching": True},
}  # fmt: skip


@pytest.mark.parametrize("version", TABLE, ids=lambda v: ".".join(map(str, v)))
def test_each_version_has_the_rules_read_in_its_release(version):
    found = rules(version)
    for name, value in TABLE[version].items():
        assert getattr(found, name) == value, (version, name)


def test_every_change_names_its_source_and_the_changes_run_oldest_first_from_the_oldest_read():
    for name, changes in CHANGES.items():
        assert changes[0].since == OLDEST[:2], name
        assert [c.since for c in changes] == sorted({c.since for c in changes}), name
        assert all(change.source for change in changes), name


def test_the_rules_fingerprint_follows_the_rules_not_the_version():
    assert rules((0, 25, 0)).fingerprint() == rules((0, 25, 3)).fingerprint()
    assert rules((0, 33, 0)).fingerprint() != rules((0, 34, 0)).fingerprint()
    changed_at = {change.since for changes in CHANGES.values() for change in changes}  # a new set of rules each
    assert len({rules((0, minor, 0)).fingerprint() for minor in range(25, 35)}) == len(changed_at)


def test_the_support_range_is_what_the_docs_say():
    from tests.harness import ROOT

    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert f"vLLM {vllm_versions.label(OLDEST)}" in deploy and vllm_versions.label(NEWEST_READ) in deploy
