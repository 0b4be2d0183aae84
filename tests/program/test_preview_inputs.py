"""What pulumi-command must be able to read in a new stack's first preview, where every output a provider
computes is unknown: no trigger, command or connection of a step may be a secret that is unknown then.
pulumi-command 1.2.1 refuses an unknown secret there before anything runs ("triggers[2]: malformed secret:
missing value"), so a user's first `pulumi up` (which previews first) could never start. The mocks return
the outputs a resource names in additionalSecretOutputs as secret, as the engine does (tests/harness.py)."""

import pytest

from tests.harness import REMOTE_COMMAND, run_program, shared_run
from tests.program.test_deployments_program import run_fleet
from tests.program.test_program import HOST_KEY, SECRETS, prod, stack_file

COMMAND_FIELDS = ("triggers", "create", "update", "delete")


def _example(stack: str):
    if stack == "fleet":
        return run_fleet()
    if stack == "prod":
        return shared_run(prod(), SECRETS, stack="prod")
    cfg = stack_file(stack)
    for node in cfg["nodes"]:
        node.setdefault("hostKey", HOST_KEY)
    return run_program(cfg, SECRETS, stack=stack)


@pytest.mark.parametrize("stack", ["dev", "staging", "staging-mtp", "prod", "fleet"])
def test_no_step_needs_a_secret_the_first_preview_cannot_know(stack):
    steps = [r for r in _example(stack).registrations if r.typ == REMOTE_COMMAND]
    assert steps
    secret = {r.name: paths for r in steps if (paths := [p for p in r.secret_paths() if p.startswith(COMMAND_FIELDS)])}
    assert secret == {}
    # The connection may be secret (the SSH key): then it comes from config alone, known in every preview.
    from_outputs = {r.name: r.property_dependencies["connection"] for r in steps
                    if "connection" in r.secret_paths() and r.property_dependencies.get("connection")}  # fmt: skip
    assert from_outputs == {}
