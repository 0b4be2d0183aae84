"""components/scripts/node_contract.py's one way between its dataclasses and JSON, both sides."""

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


def test_a_contract_compares_hashes_shows_and_freezes_as_a_frozen_dataclass_does():
    """`contract` leaves equality, hash and repr to Contract (written once instead of compiled per class): each as
    the dataclass module's own would be."""
    one, same, other = _Pair(1, None), _Pair(1), _Pair(2)
    ref, ref_same, ref_other = _DataclassPair(1, None), _DataclassPair(1), _DataclassPair(2)
    assert (one == same, one == other, one != other) == (ref == ref_same, ref == ref_other, ref != ref_other)
    assert hash(one) == hash(ref) and hash(one) == hash(same)
    assert repr(_Pair(1, ["x"])) == repr(_DataclassPair(1, ["x"])).replace("_DataclassPair", "_Pair")
    assert one != ref and ref != one  # another class: not equal, either way round
    for unhashable in (_Pair(1, []), _DataclassPair(1, [])):
        with pytest.raises(TypeError):
            hash(unhashable)
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.a = 3  # type: ignore[misc]


def test_every_contract_of_the_node_side_is_made_by_contract():
    """A class written as @dataclass(frozen=True) would work and cost its programs' starts its own methods."""
    made = [
        value for value in vars(contract).values() if isinstance(value, type) and issubclass(value, contract.Contract)
    ]
    assert len(made) > 50
    for cls in made:
        if cls is contract.Contract:
            continue
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        assert (cls.__eq__, cls.__hash__, cls.__repr__) == (
            contract.Contract.__eq__, contract.Contract.__hash__, contract.Contract.__repr__), cls  # fmt: skip
