"""The scale benchmark measures what it says: chain length, class mix, and a tiny run end to end.

Timings are not asserted here (they belong to the benchmark's own report); the structure is.
"""

import re

import pytest

from benchmarks import program_scale
from tests.harness import Registration


def reg(name, *, custom=True, parent="", provider="", deps=(), typ="test:index:T"):
    return Registration(
        typ=typ,
        name=name,
        urn=f"urn:{name}",
        parent=f"urn:{parent}" if parent else "",
        provider=f"urn:{provider}::id" if provider else "",
        custom=custom,
        inputs={},
        wire={},
        dependencies=[f"urn:{d}" for d in deps],
        delete_before_replace=False,
        additional_secret_outputs=[],
    )


def test_longest_chain_follows_dependencies_and_providers_through_components():
    regs = [
        reg("provider"),
        reg("group", custom=False),
        reg("a", parent="group", provider="provider"),
        reg("b", parent="group", deps=["a"]),
        reg("c", deps=["group"]),  # a component dependency stands for every custom under it
        reg("lone"),
    ]
    assert program_scale.longest_chain(regs) == (4, ["provider", "a", "b", "c"])


def test_parents_are_not_edges():
    regs = [reg("group", custom=False), reg("a", parent="group"), reg("b", parent="group")]
    assert program_scale.longest_chain(regs)[0] == 1


def test_class_mix_counts_components_as_one_class():
    regs = [reg("x", custom=False, typ="spark-vllm:index:RayNode"), reg("y", custom=False), reg("z", typ="t:C")]
    assert program_scale.class_mix(regs) == {program_scale.COMPONENT: 2, "t:C": 1}


def test_the_registration_floor_refuses_a_class_it_cannot_build_bare():
    spec = program_scale.unit_spec("aws:s3/bucket:Bucket", 1)
    with pytest.raises(Exception, match="no minimal constructor for aws:s3/bucket:Bucket"):
        program_scale.run_registration_floor(spec)


def test_a_tiny_run_reports_every_target(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_VLLM_HOME", str(tmp_path))
    code = program_scale.main(["--nodes", "2", "3", "--repeats", "1", "--unit-count", "2"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    rows = re.findall(r"^\s+(\d+) \|\s+(\d+) \((\d+)\)", out, re.M)
    # 16 per node (the host check's included) + 14 (the edge's 4, vLLM's key, the smoke test through the edge)
    assert [(int(n), int(total)) for n, total, _ in rows] == [(2, 46), (3, 62)]
    for target in ("ratio at 3 nodes", "resources linear in nodes: 16 resources per added node",
                   "time linear in nodes", "longest chain at 2 = 14, at 3 = 14"):  # fmt: skip
        assert re.search(rf"^(PASS|FAIL): {re.escape(target)}", out, re.M), target
    for cls in ("docker:index/container:Container", "command:remote:Command", "pulumi:providers:docker"):
        assert re.search(rf"^  {re.escape(cls)}\s+\d+\.\d\d ms", out, re.M), cls
    assert "NOTE: against the trivial floor" in out


def test_a_whole_figure_reads_the_same_in_the_floor_message_as_in_the_stack_output():
    """180.0 tokens/s comes back from the stack's outputs as 180: the message says 180 too (seen in CI)."""
    from components.config import ReleaseConfig
    from components.resources.release import describe_benchmark, floor_problems

    bench = {"outputTokensPerSecond": 180.0, "requestsPerSecond": 11.25, "ttftMs": {"p50": 16.5, "p99": 27.0},
             "itlMs": {"p50": 10.0, "p99": 13.28}, "errors": 0.0, "tool": "spark-vllm", "settings": {}}  # fmt: skip
    floors = ReleaseConfig.model_validate({"minOutputTokensPerSecond": 100000, "maxP99TtftMs": 20})
    problems = floor_problems({"benchmark": bench}, "staging", floors)
    assert "its release made 180 output tokens/s, below the floor 100000" in problems[0]
    assert "p99 time to first token was 27 ms, above the ceiling 20" in problems[1]
    assert describe_benchmark(bench).startswith("180 output tokens/s, 11.25 requests/s, TTFT p50 16.5 / p99 27 ms")
