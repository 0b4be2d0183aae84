"""The registration floor: the real program's resource tree rebuilt from the same SDK classes, bare.

Run by `benchmarks.program_scale` through `tests.harness.run_program`, like the real program.
Stack config `floorSpec` lists the real run's registrations in order as [type, name, custom,
parent URN, provider URN]. Each is registered again with the same type, name, parent and provider
and the fewest inputs the SDK class takes, with no dependencies and no Output plumbing: what
registering these resources costs by itself. The gap between it and the trivial floor is what the
resource classes cost (docker.Container alone has 78 output properties, each one an Output); the
gap between the real program and it is what the program adds, and the ratio target is checked on it.
Also run with a spec of one class only, for the per-class cost table.
"""

import json

import pulumi
import pulumi_command as command
import pulumi_docker as docker

CONNECTION = command.remote.ConnectionArgs(host="10.0.0.1")
MINIMAL = {
    "pulumi:providers:docker": lambda name, opts: docker.Provider(name, opts=opts),
    "docker:index/remoteImage:RemoteImage": lambda name, opts: docker.RemoteImage(name, name="img", opts=opts),
    "docker:index/container:Container": lambda name, opts: docker.Container(name, image="img", opts=opts),
    "command:remote:Command": lambda name, opts: command.remote.Command(name, connection=CONNECTION, opts=opts),
    "command:local:Command": lambda name, opts: command.local.Command(name, opts=opts),
}

spec = json.loads(pulumi.Config("spark-vllm").require("floorSpec"))
by_urn: dict[str, pulumi.Resource] = {}
for index, (typ, name, custom, parent, provider) in enumerate(spec["registrations"]):
    opts = pulumi.ResourceOptions(parent=by_urn.get(parent), provider=by_urn.get(provider))
    if not custom:
        resource = pulumi.ComponentResource(typ, name, None, opts)
        resource.register_outputs({})
    elif typ in MINIMAL:
        resource = MINIMAL[typ](name, opts)
    elif typ.startswith("test:"):  # the unit-cost table's bare CustomResource
        resource = pulumi.CustomResource(typ, name, {"x": index}, opts=opts)
    else:
        # A class the program started using: add it to MINIMAL, or this floor would understate it.
        raise ValueError(f"registration floor: no minimal constructor for {typ}")
    by_urn[spec["urns"][index]] = resource
pulumi.export("count", len(by_urn))
