"""The trivial floor: a bare Pulumi program that only registers trivial resources.

Run by `benchmarks.program_scale` through the very same `tests.harness.run_program` machinery
(mocks, RecordingMonitor, runpy) as the real `__main__.py`. It registers `floorComponents`
ComponentResources and `floorCustoms` CustomResources with one small input each, the customs
spread over the components as children, so the mix mirrors the real program's. Its time is what
that many of the cheapest registrations Pulumi has cost. What registering the program's own
resource classes costs is the registration floor (`benchmarks/registration_floor`), which the ratio target
is checked against; see `benchmarks/program_scale.py` for why.
"""

import pulumi

config = pulumi.Config("spark-vllm")
n_components = config.require_int("floorComponents")
n_customs = config.require_int("floorCustoms")


def trivial_component(name: str) -> pulumi.ComponentResource:
    # No subclass: a class defined in this file would be a new class on every run, and Pulumi's
    # caches keep such classes (and through them the whole run) alive across runs.
    component = pulumi.ComponentResource("test:index:TrivialComponent", name)
    component.register_outputs({})
    return component


parents = [trivial_component(f"component-{i}") for i in range(n_components)]
customs = [
    pulumi.CustomResource(
        "test:index:Trivial",
        f"custom-{i}",
        {"x": i},
        opts=pulumi.ResourceOptions(parent=parents[i % len(parents)] if parents else None),
    )
    for i in range(n_customs)
]
pulumi.export("count", len(parents) + len(customs))
