"""The node checks as a list (components/resources/checks/): a check is a step on each node and a judge of every node's
result; the gate runs whatever the list holds. A check added to the list runs on every node, in its stage, and
its judge's refusal leaves nothing started."""

import pytest

from components.resources import node_checks
from components.resources.checks import CHECKS, Stage
from components.resources.checks.protocol import Check
from tests.harness import FakeCloud, run_program
from tests.program.test_program import SECRETS, prod


class ClockSkew(Check):
    """What a new check is: a step on the node and a judge of every node's stdout."""

    name = "clock-check"
    stage = Stage.NODE

    def command(self, on):
        return f"date +%s # {on.node.name}"

    def triggers(self, on):
        return [on.image_id]

    def judge(self, cfg, outs, found):
        skewed = sorted(node for node, out in outs.items() if "skew" in out)
        if skewed:
            raise RuntimeError(f"clock skew on {', '.join(skewed)}")
        return True


class Clocks(FakeCloud):
    def __init__(self, skewed=()):
        super().__init__()
        self.skewed = set(skewed)

    def new_resource(self, args):
        made, outputs = super().new_resource(args)
        node = args.name.removesuffix("-clock-check")
        if args.name.endswith("-clock-check"):
            outputs["stdout"] = "skew" if node in self.skewed else "1764849600"
        return made, outputs


@pytest.fixture
def with_clock_check(monkeypatch):
    monkeypatch.setattr(node_checks, "CHECKS", (*CHECKS, ClockSkew()))


def test_the_list_holds_every_check_in_the_order_its_stages_run():
    names = [check.name for check in CHECKS]
    assert names == [
        "fabric-gate",
        "preflight",
        "model-fingerprint",
        "image-check",
        "host-check",
        "gpu-check",
        "fabric-nccl",
    ]
    assert [check.stage for check in CHECKS] == sorted(
        (check.stage for check in CHECKS), key=[Stage.FABRIC, Stage.NODE, Stage.ACROSS].index
    )


def test_a_check_added_to_the_list_runs_on_every_node_after_its_preflight_and_holds_the_gate(with_clock_check):
    run = run_program(prod(), SECRETS, stack="prod", mocks=Clocks())
    gate = run.named("spark-vllm-checks-passed")
    for node in ("spark-01", "spark-02"):
        step = run.named(f"{node}-clock-check")
        assert step.inputs["create"] == f"date +%s # {node}"
        assert run.named(f"{node}-preflight").urn in step.dependencies
        assert step.urn in gate.dependencies


def test_its_judge_refusing_one_node_leaves_nothing_started(with_clock_check):
    cloud = Clocks(skewed={"spark-02"})
    with pytest.raises(Exception, match=r"clock skew on spark-02"):
        run_program(prod(), SECRETS, stack="prod", mocks=cloud)
    assert not [name for name in cloud.containers if name != "spark-vllm.guard"]


def test_a_check_a_stack_does_not_want_makes_no_step():
    run = run_program(prod(container={"gpus": False}), SECRETS, stack="prod")
    assert not [r for r in run.registrations if r.name.endswith("-gpu-check")]
    assert run.named("spark-01-preflight") and run.named("spark-01-image-check")
