"""Operating it, under mocks: what memory.oomGuard hands each node's supervisor."""

import json

from tests.harness import run_program
from tests.program.test_program import SECRETS, prod


def spec_of(run, name):
    stdin = run.named(name).inputs["stdin"]
    return json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1]))["spec"]


def test_the_oom_guard_hands_the_os_reserve_to_every_supervisor_and_off_hands_nothing():
    guarded = run_program(prod(memory={"oomGuard": True, "osReserveGib": 10}), SECRETS, stack="prod")
    assert spec_of(guarded, "spark-vllm-serve")["oom_guard_mib"] == 10 * 1024
    plain = run_program(prod(), SECRETS, stack="prod")
    assert "oom_guard_mib" not in spec_of(plain, "spark-vllm-serve")  # off: no key, so no vLLM restart on upgrade
