"""components/scripts/node_contract.py's one way between its contract classes and JSON, both sides; the classes
themselves held to what `@dataclass(frozen=True)` would make of them."""

import dataclasses
import json
from typing import Optional

import pytest

from components.scripts import node_contract as contract
from components.scripts.node_contract import (
    KEEPER_MODES,
    GuardApi,
    GuardParams,
    GuardSpec,
    KeeperParams,
    KeeperSmokeParams,
    KeeperStepParams,
    KeeperWorkerParams,
    KeeperWorkersParams,
    RouterWorker,
    Served,
    SupervisorParams,
    VllmSpec,
    params_of,
)

SPEC = GuardSpec(peers=["10.0.0.2"], interface="enp1s0f1np1", guarded=[[6379, 6379]], ephemeral=True, public=[22],
                 api=GuardApi(sources=["192.0.2.0/24"], ports=[8000, 30000]))  # fmt: skip


def test_nested_contracts_come_back_as_themselves_through_json():
    params = GuardParams(node="spark-01", action="run", spec=SPEC, hash="h", host_root="/host", marker="/m",
                         check_seconds=5, timeout_seconds=60)  # fmt: skip
    again = GuardParams.from_json(json.loads(json.dumps(params.to_json())))
    assert again == params and isinstance(again.spec.api, GuardApi)
    assert again.spec.api.port is None and "port" not in params.to_json()["spec"]["api"]  # OMIT_NONE


def test_a_list_of_contracts_and_an_optional_one():
    worker = {"url": "http://10.0.0.1:8000", "model": "m", "replica": "spark-vllm-a", "root": None, "max_model_len": 8}
    keeper = KeeperWorkersParams.from_json({**KEEPER, "mode": "workers", "timeout": 30, "workers": [worker]})
    assert keeper.workers == [RouterWorker(**worker)]
    assert keeper.to_json()["workers"] == [worker]


KEEPER = {"mode": "serve", "host": "0.0.0.0", "port": 80, "inner_port": 81, "metrics_host": "10.0.0.1",
          "metrics_port": 82, "policy": "round_robin", "version": "0.1", "index_url": None, "health_interval": 5}  # fmt: skip
WORKER = {"url": "http://10.0.0.1:8000", "model": "m", "replica": "spark-vllm-a", "root": None, "max_model_len": None}


@pytest.mark.parametrize(
    "mode, own, cls",
    [
        ("serve", {}, KeeperParams),
        ("ready", {"timeout": 30}, KeeperStepParams),
        ("workers", {"timeout": 30, "workers": [WORKER]}, KeeperWorkersParams),
        ("drain", {"timeout": 30, "worker": WORKER}, KeeperWorkerParams),
        ("undrain", {"timeout": 30, "worker": WORKER}, KeeperWorkerParams),
        (
            "smoke",
            {"timeout": 30, "models": ["m"], "prompt": "Hi", "max_tokens": 4, "wait_served_seconds": 20},
            KeeperSmokeParams,
        ),
    ],
)
def test_each_keeper_mode_has_its_type_and_takes_its_own_keys_only(mode, own, cls):
    """One type per mode (as the copy's roles): a mode's keys are required of it, another mode's refused."""
    assert KEEPER_MODES[mode] is cls
    params = cls.from_json({**KEEPER, "mode": mode, **own})
    assert params.to_json() == {**KEEPER, "mode": mode, **own}  # the serve program's text is the shared keys alone
    for key in own:  # each of its own keys is needed
        with pytest.raises(TypeError):
            cls.from_json({**KEEPER, "mode": mode, **{k: v for k, v in own.items() if k != key}})
    others = {"timeout": 1, "workers": [], "worker": WORKER, "models": [], "prompt": "x", "max_tokens": 1,
              "wait_served_seconds": 1}  # fmt: skip
    for key, value in others.items():  # another mode's key is refused, not carried
        if key not in own:
            with pytest.raises(TypeError):
                cls.from_json({**KEEPER, "mode": mode, **own, key: value})


def test_the_keepers_smoke_leaves_out_what_is_not_set():
    smoke = KeeperSmokeParams.from_json({**KEEPER, "mode": "smoke", "timeout": 3, "models": ["m"], "prompt": "Hi",
                                         "max_tokens": 4, "wait_served_seconds": 1})  # fmt: skip
    assert {"api_key", "tls_ca", "server_name"}.isdisjoint(smoke.to_json())
    with_key = KeeperSmokeParams.from_json({**smoke.to_json(), "api_key": "sk-1"})
    assert with_key.to_json()["api_key"] == "sk-1"


def test_omitted_fields_stay_omitted_so_turning_nothing_on_changes_no_container():
    params = SupervisorParams(node="n", executor="ray", run_dir="/run", ray_argv=None, stop_grace_seconds=30)
    assert "guard_marker" not in params.to_json() and "metrics_port" not in params.to_json()
    assert SupervisorParams.from_json(params.to_json()) == params


def test_the_served_part_and_the_spec_file_are_one_shape():
    served = Served(recovery=contract.Recovery(3, 600, 5, 60, 120), gpu_memory_utilization=0.9, health_url=None,
                    ray_ready=contract.RayReady("10.0.0.1:6379", 2, 2))  # fmt: skip
    spec = VllmSpec(argv=["vllm"], env={"A": "1"}, fingerprint="f", **vars(served))
    data = json.loads(json.dumps(spec.to_json()))
    assert set(data) == {"recovery", "gpu_memory_utilization", "health_url", "ray_ready", "argv", "env", "fingerprint"}
    assert VllmSpec.from_json(data) == spec and VllmSpec.from_json(data).ray_ready.gpus == 2


@pytest.mark.parametrize(
    "fields",
    [
        {"node": "n", "image": "i", "timeout_seconds": 1, "progress_seconds": 1, "extra": 1},  # a key unknown
        {"node": "n", "image": "i", "timeout_seconds": 1},  # one missing
    ],
)
def test_a_key_one_side_does_not_know_fails_loudly(fields):
    with pytest.raises(TypeError):
        params_of(contract.PullParams, **fields)


def test_a_nested_dict_is_checked_too():
    with pytest.raises(TypeError):
        params_of(GuardParams, node="n", action="run", spec={**SPEC.to_json(), "pears": []}, hash="h",
                  host_root="/", marker="/m", check_seconds=1, timeout_seconds=1)  # fmt: skip


def test_the_supervisors_state_is_a_named_state_both_ways():
    """status.json carries the state's words (what an operator and an older reader see); every reader gets the
    VllmState by name, and a state no VllmState names is refused, not read as a string."""
    status = contract.SupervisorStatus(node="n", executor="mp", state=contract.VllmState.WAITING_TURN)
    written = json.loads(json.dumps(status.to_json()))
    assert written["state"] == "waiting for the GPU turn"
    assert contract.SupervisorStatus.from_json(written).state is contract.VllmState.WAITING_TURN
    assert f"supervisor: {status.state}" == "supervisor: waiting for the GPU turn" == f"supervisor: {str(status.state)}"
    with pytest.raises(ValueError, match="'dancing' is not a valid VllmState"):
        contract.SupervisorStatus.from_json({**written, "state": "dancing"})


@contract.contract
class _Pair(contract.Contract):
    a: int
    b: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class _DataclassPair:
    a: int
    b: Optional[list] = None


@contract.contract
class _Base(contract.Contract):
    x: int
    y: str = "y"
    z: list = contract.field(default_factory=list)


@contract.contract
class _Child(_Base):
    y: str = "again"  # named again: keeps its place, takes this default
    w: dict = contract.field(default_factory=dict)
    v: int = contract.field(default=7)

    OMIT_NONE = ()  # not annotated: not a field


@dataclasses.dataclass(frozen=True)
class _DataclassBase:
    x: int
    y: str = "y"
    z: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _DataclassChild(_DataclassBase):
    y: str = "again"
    w: dict = dataclasses.field(default_factory=dict)
    v: int = dataclasses.field(default=7)


def test_a_contract_compares_hashes_shows_and_freezes_as_a_frozen_dataclass_does():
    """A contract is made without the dataclasses module (every node program imports node_contract.py): equality,
    hash, repr and frozenness each as a frozen dataclass's would be."""
    one, same, other = _Pair(1, None), _Pair(1), _Pair(2)
    ref, ref_same, ref_other = _DataclassPair(1, None), _DataclassPair(1), _DataclassPair(2)
    assert (one == same, one == other, one != other) == (ref == ref_same, ref == ref_other, ref != ref_other)
    assert hash(one) == hash(ref) and hash(one) == hash(same)
    assert repr(_Pair(1, ["x"])) == repr(_DataclassPair(1, ["x"])).replace("_DataclassPair", "_Pair")
    assert one != ref and ref != one  # another class: not equal, either way round
    for unhashable in (_Pair(1, []), _DataclassPair(1, [])):
        with pytest.raises(TypeError):
            hash(unhashable)
    for frozen in (one, ref):
        with pytest.raises(AttributeError, match="cannot assign to field 'a'"):
            frozen.a = 3  # type: ignore[misc]
        with pytest.raises(AttributeError, match="cannot delete field 'a'"):
            del frozen.a  # type: ignore[misc]
    with pytest.raises(contract.FrozenInstanceError):
        one.a = 3  # type: ignore[misc]


def test_a_contracts_fields_defaults_and_init_are_a_frozen_dataclasss():
    """Fields in a dataclass's order (a base's first, one named again in its place), defaults and factories (a new
    list each time), positional and keyword arguments, and each refusal of __init__ a TypeError as the dataclass's."""
    ours = [(f.name, f.type) for f in contract.fields(_Child)]
    assert ours == [(f.name, f.type) for f in dataclasses.fields(_DataclassChild)]
    assert contract.fields(_Child(1)) == contract.fields(_Child)
    made, ref = _Child(1), _DataclassChild(1)
    assert [getattr(made, name) for name, _ in ours] == [getattr(ref, name) for name, _ in ours]
    assert _Child(1).z is not _Child(1).z and _Child(1).z == []
    assert repr(_Child(1, "b", [2], {}, 3)) == repr(_DataclassChild(1, "b", [2], {}, 3)).replace(
        "_DataclassChild", "_Child"
    )
    for args, kwargs in (((), {}), ((1, "a", [], {}, 2, 9), {}), ((1,), {"nope": 1}), ((1,), {"x": 2})):
        with pytest.raises(TypeError) as theirs:
            _DataclassChild(*args, **kwargs)
        with pytest.raises(TypeError) as mine:
            _Child(*args, **kwargs)
        assert str(mine.value) == str(theirs.value).replace("_DataclassChild", "_Child")
    with pytest.raises(TypeError) as theirs:
        _DataclassPair()
    with pytest.raises(TypeError) as mine:
        _Pair()
    assert str(mine.value) == str(theirs.value).replace("_DataclassPair", "_Pair")
    changed, ref_changed = made.replace(y="z"), dataclasses.replace(ref, y="z")
    assert (changed.x, changed.y, changed.z, made.y) == (ref_changed.x, ref_changed.y, ref_changed.z, "again")
    assert changed == _Child(1, "z") and changed != made
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        made.replace(nope=1)
    with pytest.raises(TypeError, match="non-default argument 'late' follows default argument"):

        @contract.contract
        class _Late(contract.Contract):
            early: int = 1
            late: int  # type: ignore[misc]

    with pytest.raises(ValueError):
        contract.field(default=1, default_factory=list)


def test_node_programs_import_no_dataclasses():
    """What every node program imports costs every start: node_contract.py without `dataclasses` (and its
    `inspect`) is 32-43 ms less of each (Debian's Python 3.11, 2026-12-07)."""
    import subprocess
    import sys

    from tests.harness import ROOT

    code = "import sys, components.scripts.node_contract; print(sorted({'dataclasses', 'inspect'} & set(sys.modules)))"
    found = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert found.stdout.strip() == "[]"


def test_every_contract_of_the_node_side_is_made_by_contract():
    """A class written as @dataclass(frozen=True) would work and cost its programs' starts the dataclasses module and
    its own methods."""
    made = [
        value for value in vars(contract).values() if isinstance(value, type) and issubclass(value, contract.Contract)
    ]
    assert len(made) > 50
    for cls in made:
        if cls is contract.Contract:
            continue
        assert "__contract_fields__" in vars(cls) and not dataclasses.is_dataclass(cls), cls
        assert all(getattr(cls, name) is getattr(contract.Contract, name)
                   for name in ("__init__", "__eq__", "__hash__", "__repr__", "__setattr__")), cls  # fmt: skip
