"""Fixtures of the rehearsal: simulated nodes with their registry, the image in it, and stacks driven
by the real Pulumi CLI (tests/e2e/cli_stack.py)."""

from __future__ import annotations

import itertools
import os

import pytest

from tests.e2e import nodes as simnodes
from tests.e2e import seed
from tests.e2e.cli_stack import RehearsalStack, cli_missing, prune_stale_bytecode
from tests.e2e.image.build import publish, publish_prometheus
from tests.e2e.rehearsal import CACHE_DIR, make_model
from tests.ssh_agent import ssh_agent

_counter = itertools.count()


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """One registry for every simulated site of the session (staging and prod pull from the same one)."""
    reason = simnodes.skip_reason()
    if reason:
        pytest.skip(reason)
    simnodes.cleanup_stale(strict=False)
    prune_stale_bytecode(tmp_path_factory.getbasetemp())
    # each test process's registry at its own fixed address while it is free (gw0 10.76.200.1, gw1 .201, …; one
    # process .199): the image seeds it names are then found again by later runs (tests/e2e/seed.py)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    subnet = 200 + int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 199
    storage = CACHE_DIR / "registry"
    with simnodes.create_registry(tmp_path_factory.mktemp("registry"), storage, subnet=min(subnet, 254)) as created:
        yield created


# The fabric interface is named differently on node-2, as when one box names its port enp1s0f1np1 and the
# other not: every setting that carries an interface must reach each node with that node's own name.
FABRIC_INTERFACES = ("fab0", "enp1s0f1np1")


@pytest.fixture(scope="session")
def image_seed(registry):
    """A Docker data root with the rehearsal image pulled once (tests/e2e/seed.py), that nodes start from."""
    return seed.image_seed(CACHE_DIR, registry.address)


def _cluster(count, registry, tmp_path_factory, request):
    """Nodes whose daemons already hold the image, unless the module sets NODES_WITHOUT_IMAGE = True (it proves
    how the image gets there: its first `up` pulls, or copies, on every node)."""
    planted = None if getattr(request.module, "NODES_WITHOUT_IMAGE", False) else request.getfixturevalue("image_seed")
    with simnodes.simulated_nodes(
        count, tmp_path_factory.mktemp("simnodes"), registry=registry, fabric_interfaces=FABRIC_INTERFACES, seed=planted
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def sim_cluster(registry, tmp_path_factory, request):
    yield from _cluster(2, registry, tmp_path_factory, request)


@pytest.fixture(scope="module")
def sim_cluster3(registry, tmp_path_factory, request):
    yield from _cluster(3, registry, tmp_path_factory, request)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rehearsal-models"))


def _image(cluster):
    return publish(CACHE_DIR, cluster.registry.address, cluster.nodes[0].docker_host)


@pytest.fixture(scope="module")
def image(sim_cluster):
    return _image(sim_cluster)


@pytest.fixture(scope="module")
def prometheus_image(sim_cluster, image):
    """A real Prometheus (Debian's) in an image of the cluster's registry, as prom/prometheus would be."""
    return publish_prometheus(CACHE_DIR, sim_cluster.registry.address, sim_cluster.nodes[0].docker_host, image)


@pytest.fixture(scope="module")
def image3(sim_cluster3):
    return _image(sim_cluster3)


@pytest.fixture(scope="module")
def ssh_agent3(sim_cluster3, tmp_path_factory):
    with ssh_agent(tmp_path_factory.mktemp("agent"), keys=(sim_cluster3.client_key_path,)) as sock:
        yield sock


@pytest.fixture(scope="module")
def new_stack(tmp_path_factory):
    """A factory of stacks on their own deploying machines. What a stack still holds at the end of the module is
    not destroyed: its nodes go with the module (the cluster kills their containers, then their daemons and
    namespaces), and a `pulumi destroy` there would cost 10-25 s of a loaded machine to prove nothing. The tests
    that claim something of a destroy (a fresh clone's, the guard's, prod's) run and assert it themselves.
    Their `pulumi` commands write the state once a command (`checkpoints=False`, cli_stack.py) and their secrets are
    written into the stack file encrypted (`typed=False`), except where a test passes `checkpoints=True`: the README's
    path (test_rehearsal.py, test_one_node.py) runs as a user's CLI does, `pulumi config set --secret` included."""
    reason = cli_missing()
    if reason:
        pytest.fail(reason)  # setup builds it; a rehearsal without the real CLI would prove nothing

    def make(stack: str = "rehearsal", **kwargs) -> RehearsalStack:
        kwargs.setdefault("checkpoints", False)
        kwargs.setdefault("typed", kwargs["checkpoints"])  # secrets as the README sets them, where its path is run
        created = RehearsalStack(tmp_path_factory.mktemp(f"deployer-{next(_counter)}"), stack, **kwargs)
        created.init()
        return created

    return make
