"""Inputs that used to slip through, refused before anything starts: a table of spellings per class
(the class, not one example), and properties over extraArgs and paths.

Classes: a secret set but empty; vLLM flags spelled as vLLM's parser reads them; paths that leave where
they should be; fabric addresses that can never work; keys that are not what they say; a stack
promoting from itself; a misspelt namespace.
"""

from __future__ import annotations

import argparse
import functools
import json
import posixpath
import re
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from components.config import ConfigError, load_cluster_config, near_namespace
from components.config.deployments import DeploymentConfig
from components.config.models import ClusterConfig
from components.config.ssh_keys import host_key_problem, private_key_problem
from components.config.types import ModelRef
from components.config.vllm_args import MANAGED_FLAGS, REFUSED_FLAGS, SECRET_FLAGS, normalise, read_extra_args
from tests.harness import ROOT
from tests.keys import ed25519_public_blob, host_key_line, openssh_private_key
from tests.unit.test_config import config

KEY = openssh_private_key("inputs")


def problems_of(raw, **context):
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw, **context)
    return caught.value.problems


def only_problem(raw, path, **context):
    problems = problems_of(raw, **context)
    assert [p.split(": ", 1)[0] for p in problems] == [path], problems
    return problems[0]


# --- 1. a secret that is set but empty ---------------------------------------------------------------

EMPTY_SECRETS = [
    ("apiKey", ""),
    ("apiKey", " "),
    ("apiKey", "\n"),
    ("apiKey", "\t \n"),
    ("hfToken", ""),
    ("hfToken", "  "),
    ("sshPrivateKey", ""),
    ("sshPrivateKey", "\n\n"),
]


@pytest.mark.parametrize(("key", "value"), EMPTY_SECRETS)
def test_a_secret_set_but_empty_is_refused_even_where_no_key_is_needed(key, value):
    # allowUnauthenticated (the base config) would accept no apiKey at all: an empty one is a mistake still
    problem = only_problem(config(**{key: value}), key)
    assert problem.startswith(f"{key}: '[secret]' — ")
    assert "empty" in problem


def test_an_empty_api_key_is_not_an_api_key_for_the_bind_rule():
    problems = problems_of(config(apiKey="", vllm__allowUnauthenticated=False))
    assert [p.split(":")[0] for p in problems] == ["apiKey"]
    assert "the edge would ask no key of its clients" in problems[0]


# What one word of an HTTP header cannot carry whole (RFC 9110 field values: visible ASCII), or what a proxy reads
# as two values (a comma): each spelling a key could be typed or pasted with.
UNSENDABLE_KEYS = {
    "a space": "sk-0000 11112222333",
    "a newline copied with it": "sk-00001111222233334444\n",
    "a CR LF": "sk-00001111222233334444\r\n",
    "a tab": "\tsk-00001111222233334444",
    "DEL": "sk-0000111122223333\x7f",
    "NUL": "sk-0000111122223333\x00x",
    "a comma": "sk-0000111122,223333444",
    "two keys as one header list": "sk-aaaaaaaaaaaaaaaa,sk-bbbbbbbbbbbbbbbb",
    "a no-break space": "sk-0000111122223333\u00a0",
    "a zero-width space": "sk-0000\u200b111122223333",
    "a letter outside ASCII": "sk-clé-000011112222333",
    "a full-width comma": "sk-00001111\uff0c22223333",
    "an emoji": "sk-0000111122223333\U0001f511",
    "a line separator": "sk-0000111122223333\u2028",
}


@pytest.mark.parametrize("name", UNSENDABLE_KEYS)
def test_a_key_a_header_cannot_carry_is_refused_with_the_rule_never_the_key(name):
    value = UNSENDABLE_KEYS[name]
    for keys in ({"apiKey": value}, {"apiKeys": {"alice": value}}):
        path = "apiKey" if "apiKey" in keys else "apiKeys.alice"
        problem = only_problem(config(**keys), path)
        assert "visible ASCII characters other than ','" in problem, problem
        shown = problem.split(" — ", 1)[1]
        assert value.strip() not in shown and "sk-0000" not in shown and "sk-aaaa" not in shown, problem


@pytest.mark.parametrize(
    "value", ["sk-" + "A" * 16, "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA==", "a.b_c~d+e/f-g!#$%&'*", "k" * 200]
)
def test_a_key_of_visible_ascii_is_accepted(value):
    assert load_cluster_config(config(apiKey=value)).api_key.get_secret_value() == value


# --- 2. vLLM flags spelled another way ---------------------------------------------------------------

MANAGED_SPELLINGS = [
    (["--tensor_parallel_size=2"], "--tensor-parallel-size", "tensorParallelSize"),
    (["--tensor-parallel=2"], "--tensor-parallel-size", "tensorParallelSize"),
    (["--tensor_parallel", "2"], "--tensor-parallel-size", "tensorParallelSize"),
    (["--tensor-par", "2"], "--tensor-parallel-size", "tensorParallelSize"),
    (["-tp=2"], "-tp", "tensorParallelSize"),
    (["-t", "2"], "-tp", "tensorParallelSize"),
    (["-tp", "2"], "-tp", "tensorParallelSize"),
    (["--pipeline_parallel_size", "2"], "--pipeline-parallel-size", "pipelineParallelSize"),
    (["-pp", "2"], "-pp", "pipelineParallelSize"),
    (["--max_model_len=4096"], "--max-model-len", "maxModelLen"),
    (["--max-model", "4096"], "--max-model-len", "maxModelLen"),
    (["--gpu_memory_utilization=0.5"], "--gpu-memory-utilization", "vllm.gpuMemoryUtilization"),
    (["--gpu-mem", "0.5"], "--gpu-memory-utilization", "vllm.gpuMemoryUtilization"),
    (["--served_model_name", "x"], "--served-model-name", "vllm.servedModelName"),
    (["--trust_remote_code"], "--trust-remote-code", "vllm.trustRemoteCode"),
    (["--no_trust_remote_code"], "--no-trust-remote-code", "vllm.trustRemoteCode"),
    (["--trust"], "--trust-remote-code", "vllm.trustRemoteCode"),
    (["--enable_auto_tool_choice"], "--enable-auto-tool-choice", "vllm.enableAutoToolChoice"),
    (["--reasoning_parser=qwen3"], "--reasoning-parser", "vllm.reasoningParser"),
    (["--tool-call", "hermes"], "--tool-call-parser", "vllm.toolCallParser"),
    (["--distributed_executor_backend=mp"], "--distributed-executor-backend", "executor"),
    (["--node_rank", "1"], "--node-rank", "executor"),
    (["-r1"], "-r", "executor"),
    (["-n2"], "-n", "executor"),
    (["--master_addr=10.0.0.1"], "--master-addr", "executor"),
    (["--master_port=29501"], "--master-port", "vllm.masterPort"),
    (["--head"], "--headless", "executor"),
    (["--ho=127.0.0.1"], "--host", "vllm.host"),
    (["--po", "9000"], "--port", "vllm.port"),
    (["--model", "/models/other"], "--model", "model"),
]


# Spellings later releases read as a flag the program sets (components/config/vllm_versions.py), by the release
# that first reads them so: each refused whatever image the stack names, as extraArgs is checked before any image.
LATER_SPELLINGS = [
    ((0, 33), ["--disable-server-load-tracking"], "--disable-server-load-tracking", "vllm.stallSeconds"),
    ((0, 33), ["--disable_server_load_tracking"], "--disable-server-load-tracking", "vllm.stallSeconds"),
    ((0, 33), ["--disable-server-load"], "--disable-server-load-tracking", "vllm.stallSeconds"),
    ((0, 25), ["--no-enable-server-load-tracking"], "--no-enable-server-load-tracking", "vllm.stallSeconds"),
    ((0, 25), ["--no_enable_server_load"], "--no-enable-server-load-tracking", "vllm.stallSeconds"),
    ((0, 33), ["--disable-auto-tool-choice"], "--disable-auto-tool-choice", "vllm.enableAutoToolChoice"),
    ((0, 33), ["--disable_auto_tool"], "--disable-auto-tool-choice", "vllm.enableAutoToolChoice"),
    ((0, 31), ["--device-memory-utilization=0.95"], "--device-memory-utilization", "vllm.gpuMemoryUtilization"),
    ((0, 31), ["--device_memory_utilization", "0.95"], "--device-memory-utilization", "vllm.gpuMemoryUtilization"),
    ((0, 31), ["--device-mem", "0.95"], "--device-memory-utilization", "vllm.gpuMemoryUtilization"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("since", "args", "flag", "key"), LATER_SPELLINGS, ids=[" ".join(a) for _, a, _, _ in LATER_SPELLINGS]
)
def test_a_spelling_a_later_vllm_reads_as_a_managed_flag_is_refused_naming_its_key(since, args, flag, key):
    from components.config.vllm_versions import rules

    problem = only_problem(config(vllm__extraArgs=args), "vllm.extraArgs[0]")
    assert f"use its own key ({key})" in problem
    if normalise(args[0])[0] != flag:
        assert f"is {flag} to vLLM" in problem
    # the release it is dated by reads it so, and the one before does not
    read = rules((*since, 0))
    assert read.disable_switches or read.gpu_memory_aliases or flag.startswith("--no-")
    if since > (0, 25):
        before = rules((since[0], since[1] - 1, 0))
        assert flag not in before.gpu_memory_aliases and not (flag.startswith("--disable-") and before.disable_switches)


PREFIX_CACHING = [
    ([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
    (["--disable-prefix-caching"], False), (["--disable_prefix_caching"], False), (["--disable-prefix"], False),
    (["--no-enable-prefix"], False), (["--enable-prefix-caching", "--disable-prefix-caching"], False),
    (["--disable-prefix-caching", "--enable_prefix_caching"], True),
]  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), PREFIX_CACHING, ids=[" ".join(a) or "none" for a, _ in PREFIX_CACHING])
def test_the_memory_plan_reads_prefix_caching_as_the_last_spelling_vllm_takes(args, expected):
    from components.plan.memory import engine_knobs

    assert engine_knobs(args).prefix_caching is expected
    load_cluster_config(config(vllm__extraArgs=args))  # read, not refused: the stack may choose it


@pytest.mark.parametrize(("args", "flag", "key"), MANAGED_SPELLINGS, ids=[" ".join(a) for a, _, _ in MANAGED_SPELLINGS])
def test_a_managed_flag_under_another_spelling_is_refused_naming_its_key(args, flag, key):
    problem = only_problem(config(vllm__extraArgs=args), "vllm.extraArgs[0]")
    assert f"use its own key ({key})" in problem
    if normalise(args[0])[0] != flag:
        assert f"is {flag} to vLLM" in problem


SECRET_SPELLINGS = [
    (["--api-key", "sk-live-1"], "apiKey"),
    (["--api_key=sk-live-1"], "apiKey"),
    (["--api-k", "sk-live-1"], "apiKey"),
    (["--api-key sk-live-1"], "apiKey"),
    (["--hf_token=hf_live_1"], "hfToken"),
    (["--hf-tok", "hf_live_1"], "hfToken"),
]


@pytest.mark.parametrize(("args", "key"), SECRET_SPELLINGS, ids=[" ".join(a) for a, _ in SECRET_SPELLINGS])
def test_a_secret_flag_is_refused_and_its_value_never_shown(args, key):
    problem = only_problem(config(vllm__extraArgs=args), "vllm.extraArgs[0]")
    assert f"pulumi config set --secret {key}" in problem
    assert "live_1" not in problem and "live-1" not in problem


ONE_ELEMENT = ["--max-num-seqs 8", "--kv-cache-dtype fp8", "--enforce-eager true", "-q fp8", "--max_num_seqs  8"]


@pytest.mark.parametrize("arg", ONE_ELEMENT)
def test_a_flag_and_its_value_in_one_element_is_refused_with_the_two_elements(arg):
    problem = only_problem(config(vllm__extraArgs=[arg]), "vllm.extraArgs[0]")
    flag, rest = arg.split(None, 1)
    assert f"a flag and its value as two elements: [{flag!r}, {rest!r}]" in problem


ACCEPTED = [
    ["--max-num-seqs", "8"],
    ["--max_num_seqs=8"],
    ["--kv_cache_dtype", "fp8"],
    ["--enforce-eager"],
    ["-O3"],
    ["--compilation-config.level", "3"],
    ["--chat-template-content-format", "string"],
    ["--override-generation-config", '{"temperature": 0.6, "top_p": 0.95}'],
    ["--default-chat-template-kwargs", '{"enable_thinking": false}'],
    ["--load-format", "dummy", "--gdn-prefill-backend", "triton"],
    ["--max-num-batched-tokens=8192", "--enable-prefix-caching"],
    ["--chat-template", "/models/templates/with space.jinja"],
]


@pytest.mark.parametrize("args", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_unmanaged_flags_and_values_with_spaces_pass(args):
    load_cluster_config(config(vllm__extraArgs=args))


STRAYS = [
    (["8"], "a flag (`--name`) before it"),
    (["--"], "no bare '--'"),
    (["--config", "/etc/vllm.yaml"], "not --config"),
    (["--conf", "/etc/vllm.yaml"], "not --config"),
    (["--help"], "not --help"),
    (["--max-num-seqs=8", "16"], "a flag (`--name`) before it"),
]


@pytest.mark.parametrize(("args", "expected"), STRAYS, ids=[" ".join(a) for a, _ in STRAYS])
def test_strays_and_flags_no_stack_may_use_are_refused(args, expected):
    problems = problems_of(config(vllm__extraArgs=args))
    assert any(expected in p for p in problems), problems


def test_the_memory_plan_reads_a_flag_in_any_spelling():
    for args in (["--kv_cache_dtype", "fp8"], ["--kv-cache-dtype=fp8"], ["--kv_cache_dtype=fp8"]):
        assert read_extra_args(args).value_of("--kv-cache-dtype", args) == "fp8"
    args = ["--kv-cache-dtype", "fp8", "--kv_cache_dtype=fp8_e5m2"]
    assert read_extra_args(args).value_of("--kv-cache-dtype", args) == "fp8_e5m2"  # argparse keeps the last


# vLLM 0.25's own option strings, read from its serve parser on the GPU machine (tests/gpu/flags.py): the oracle
# below resolves prefixes among all of them, as vLLM's argparse does.
VLLM_FLAGS = json.loads((ROOT / "tests/gpu/results/2026-12-03/vllm-0.25.0-serve-flags.json").read_text())
OTHER_VLLM_FLAGS = sorted(set(VLLM_FLAGS["options"]) - {*MANAGED_FLAGS, *SECRET_FLAGS, "--config", "-h", "--help"})
# the spellings only later releases read (vllm_args._later_spellings: --disable-X from 0.33, aliases from 0.31)
LATER_ONLY = {flag for _, _, flag, _ in LATER_SPELLINGS if not flag.startswith("--no-")}


def test_every_protected_flag_is_vllms_and_none_of_vllms_others_is_a_prefix_of_one():
    """What lets the reader refuse any prefix of a protected flag: in vLLM 0.25 no other flag is one (the
    spellings of later releases aside: 0.25 has none of them)."""
    protected = {*MANAGED_FLAGS, *SECRET_FLAGS, "--config", "--help", "-h"} - LATER_ONLY
    assert protected <= set(VLLM_FLAGS["options"])
    assert not LATER_ONLY & set(VLLM_FLAGS["options"])
    assert not [(o, p) for o in OTHER_VLLM_FLAGS for p in protected if p.startswith(o)]


class _Oracle(argparse.ArgumentParser):
    def error(self, message):  # an ambiguous prefix: raised, not exited
        raise argparse.ArgumentError(None, message)


@functools.cache
def argparse_oracle() -> argparse.ArgumentParser:
    """Python's own argparse with vLLM's option strings (allow_abbrev on, as FlexibleArgumentParser leaves it).
    Built once: a parser with every option string takes 8 ms, 600 examples read it, and reading changes nothing."""
    parser = _Oracle(add_help=False)
    for flag in [*MANAGED_FLAGS, *SECRET_FLAGS, "--config", "-h", "--help", *OTHER_VLLM_FLAGS]:
        parser.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"))
    return parser


def argparse_reads(parser: argparse.ArgumentParser, arg: str) -> set[str]:
    """The option strings argparse could take `arg` as, after vLLM's rewriting; every one when ambiguous."""
    name, value = normalise(arg)
    rewritten = name if value is None else f"{name}={value}"
    try:
        found = parser._parse_optional(rewritten)
    except argparse.ArgumentError:  # ambiguous: vLLM refuses at start, between these (argparse's own matching)
        prefix = rewritten.split("=")[0] if rewritten.startswith("--") else rewritten
        return {
            flag
            for flag in parser._option_string_actions
            if flag.startswith(prefix) or (not rewritten.startswith("--") and flag == rewritten[:2])
        }
    if found is None or found[0] is None:
        return set()
    return {found[1]}


PROTECTED = [*MANAGED_FLAGS, *SECRET_FLAGS, *REFUSED_FLAGS]
spellings = st.builds(
    lambda flag, cut, underscores, value: (
        "".join(
            ch if ch != "-" or i < 2 or not underscores[i % len(underscores)] else "_"
            for i, ch in enumerate(flag[:cut])
        )
        + (f"={value}" if value else "")
    ),
    st.sampled_from([*PROTECTED, *OTHER_VLLM_FLAGS]),
    st.integers(min_value=3, max_value=40),
    st.lists(st.booleans(), min_size=1, max_size=6),
    st.sampled_from(["", "2", "a b", "fp8"]),
)


@settings(max_examples=600, deadline=None)
@given(spellings)
def test_no_spelling_argparse_reads_as_a_protected_flag_gets_through(arg):
    read_as = argparse_reads(argparse_oracle(), arg)
    refused = bool(read_extra_args([arg, "x"]).problems and read_extra_args([arg, "x"]).problems[0][0] == 0)
    if read_as & set(PROTECTED):
        assert refused, (arg, read_as)
    if read_as and not read_as & set(PROTECTED):
        assert not refused or " " in arg.split("=")[0], (arg, read_as)  # a plain unmanaged flag passes


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(SECRET_FLAGS)), st.text(alphabet="abcXYZ019-_", min_size=4, max_size=12))
def test_a_secret_value_never_appears_in_a_problem(flag, secret):
    underscored = "--" + flag[2:].replace("-", "_")
    for args in ([f"{flag}={secret}"], [flag, secret], [f"{flag} {secret}"], [f"{underscored}={secret}"]):
        shown = " ".join(f"{v} {e}" for _, v, e in read_extra_args(args).problems)
        assert secret not in shown.replace(flag, "").replace(underscored, ""), (args, shown)


# --- 3. paths that leave where they should be --------------------------------------------------------

BAD_PATHS = [
    ("/models/../etc", "'/etc'"),
    ("/models/x/..", "'/models'"),
    ("/models/./Qwen3", "'/models/Qwen3'"),
    ("/models//Qwen3", "'/models/Qwen3'"),
    ("/models/Qwen3/", "'/models/Qwen3'"),
    ("//models/Qwen3", "'/models/Qwen3'"),
    ("/models/..", "'/'"),
]


@pytest.mark.parametrize(("path", "normal"), BAD_PATHS)
@pytest.mark.parametrize("key", ["model", "container__hfCacheDir"])
def test_a_path_that_is_not_normalised_is_refused_with_its_normal_form(path, normal, key):
    problem = only_problem(config(**{key: path}), key.replace("__", "."))
    assert f"a normalised path: write it as {normal}" in problem


@pytest.mark.parametrize(
    "path", ["/etc", "/", "/proc/self", "/home/aurora", "/root", "/var/lib/docker/volumes", "/usr"]
)
@pytest.mark.parametrize("key", ["model", "container__hfCacheDir"])
def test_a_system_or_home_directory_is_refused(path, key):
    if path == "/":
        problem = problems_of(config(**{key: path}))[0]
        assert "expected" in problem or "a directory of its own" in problem
        return
    problem = only_problem(config(**{key: path}), key.replace("__", "."))
    assert "a directory of its own" in problem


@pytest.mark.parametrize(
    "path", ["/models/Qwen3-8B", "/home/aurora/models/Qwen3", "/data/hf", "/mnt/nvme/m", "/models"]
)
def test_ordinary_model_paths_pass(path):
    load_cluster_config(config(model=path))


@pytest.mark.parametrize(
    "repo", ["Qwen/Qwen3..8B", "Qwen/Qwen3--8B", "Qwen/Qwen3-8B.git", "Qwen/Qwen3-8B-", "a/" + "x" * 97]
)
def test_a_repo_id_the_hub_refuses_is_refused(repo):
    assert "repo id" in only_problem(config(model=repo), "model")


segments = st.lists(st.sampled_from(["models", "Qwen3", ".", "..", "", "a.b", "..x"]), min_size=1, max_size=5)


MODEL_REF = TypeAdapter(ModelRef)


def test_the_model_key_of_a_stack_and_of_each_deployment_is_a_model_ref():
    """The property below asks ModelRef itself (7.5 ms a whole stack's config, 400 times, was 3 CPU-s): it is the
    type of every `model` key; BAD_PATHS above go through the whole loader."""
    for cls in (ClusterConfig, DeploymentConfig):
        assert cls.model_fields["model"].annotation == Optional[ModelRef], cls


@settings(max_examples=400, deadline=None)
@given(segments, st.booleans())
def test_any_path_accepted_is_normalised_and_stays_below_where_it_starts(parts, trailing):
    path = "/" + "/".join(parts) + ("/" if trailing else "")
    try:
        model = MODEL_REF.validate_python(path)
    except ValidationError:
        return
    assert posixpath.normpath(model) == model
    assert ".." not in model.split("/") and "." not in model.split("/")


# --- 4. fabric addresses that can never work ---------------------------------------------------------

NEVER_A_FABRIC = [
    ("127.0.0.1", "loopback"),
    ("127.9.9.9", "loopback"),
    ("0.0.0.0", "0.0.0.0 means every address"),
    ("224.0.0.5", "multicast"),
    ("239.1.2.3", "multicast"),
    ("169.254.10.2", "link-local"),
    ("255.255.255.255", "broadcast"),
    ("240.0.0.7", "reserved"),
]


@pytest.mark.parametrize(("address", "why"), NEVER_A_FABRIC)
def test_an_address_that_cannot_be_a_fabric_is_refused_in_a_multi_node_cluster(address, why):
    problem = only_problem(config(nodes__1__fabricAddress=address), "nodes[1].fabricAddress")
    assert why in problem


def one_node(**changes):
    raw = config(tensorParallelSize=1, **changes)
    raw["nodes"] = raw["nodes"][:1]
    return raw


def test_one_node_may_use_loopback_but_never_an_address_of_no_host():
    load_cluster_config(one_node(nodes__0__fabricAddress="127.0.0.1"))
    load_cluster_config(one_node(nodes__0__fabricAddress="169.254.3.4"))
    assert "0.0.0.0" in only_problem(one_node(nodes__0__fabricAddress="0.0.0.0"), "nodes[0].fabricAddress")


@pytest.mark.parametrize(
    ("addresses", "prefix"),
    [(("10.9.0.1", "10.9.1.2"), 24), (("192.168.100.10", "192.168.101.10"), 24), (("10.0.0.1", "10.0.0.2"), 32),
     (("10.9.0.1", "10.10.0.1"), 16)],
)  # fmt: skip
def test_managed_fabric_addresses_must_share_one_subnet(addresses, prefix):
    raw = config(network__manage=True, network__prefixLength=prefix)
    for index, address in enumerate(addresses):
        raw["nodes"][index]["fabricAddress"] = address
    problem = only_problem(raw, "network.prefixLength")
    assert f"at /{prefix} they fall in 2" in problem and "spark-01" in problem and "spark-02" in problem


def test_managed_fabric_addresses_on_one_subnet_pass_and_unmanaged_ones_may_be_routed():
    load_cluster_config(config(network__manage=True, network__prefixLength=16, nodes__1__fabricAddress="10.9.7.2"))
    load_cluster_config(config(nodes__1__fabricAddress="10.10.0.2"))  # not managed: routing is the user's


@pytest.mark.parametrize(("address", "kind"), [("10.9.0.0", "network"), ("10.9.0.255", "broadcast")])
def test_a_managed_address_that_is_its_subnets_network_or_broadcast_address_is_refused(address, kind):
    problem = only_problem(config(network__manage=True, nodes__1__fabricAddress=address), "nodes[1].fabricAddress")
    assert f"it is the {kind} address" in problem


# --- 5. keys that are not what they say --------------------------------------------------------------


def b64(blob: bytes) -> str:
    import base64

    return base64.b64encode(blob).decode()


ECDSA_BLOB = b"\x00\x00\x00\x13ecdsa-sha2-nistp256\x00\x00\x00\x08nistp256\x00\x00\x00\x41\x04" + b"\x01" * 64
BAD_HOST_KEYS = [
    ("ssh-ed25519 " + b64(ECDSA_BLOB), "holds a key of type 'ecdsa-sha2-nistp256', not 'ssh-ed25519'"),
    ("ecdsa-sha2-nistp256 " + b64(ed25519_public_blob("x")), "not 'ecdsa-sha2-nistp256'"),
    ("ssh-ed25519 " + b64(ed25519_public_blob("x")[:-1]), "decodes to no SSH key"),
    ("ssh-ed25519 " + b64(ed25519_public_blob("x") + b"\x00\x00\x00\x01z"), "an ed25519 key is 32 bytes"),
    ("ssh-ed25519 " + host_key_line("x").split()[1][:-4], "decodes to no SSH key (a field longer than the key)"),
    ("ssh-ed25519 " + host_key_line("x").split()[1][:-1], "does not decode"),
    ("ssh-ed25519 " + host_key_line("x").split()[1] + "=", "does not decode"),
    ("ecdsa-sha2-nistp384 " + b64(ECDSA_BLOB.replace(b"nistp256", b"nistp384")), "holds a 97-byte point"),
    ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPinnedHostKeyForTests", "does not decode"),
]


@pytest.mark.parametrize(("line", "expected"), BAD_HOST_KEYS)
def test_a_host_key_whose_base64_is_not_a_key_of_its_type_is_refused(line, expected):
    problem = only_problem(config(nodes__0__hostKey=line), "nodes[0].hostKey")
    assert expected in problem and "ssh-keyscan" in problem


def test_real_shaped_host_keys_pass():
    assert host_key_problem(host_key_line("a")) is None
    assert host_key_problem("ecdsa-sha2-nistp256 " + b64(ECDSA_BLOB)) is None
    load_cluster_config(config(nodes__0__hostKey=host_key_line("a")))


BAD_PRIVATE_KEYS = [
    (host_key_line("pub"), "not a public one"),
    (host_key_line("pub") + " me@laptop\n", "not a public one"),
    ("~/.ssh/id_ed25519", "the key's contents, not a path"),
    ("/root/.ssh/id_rsa", "the key's contents, not a path"),
    ("PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\n", "not a PuTTY .ppk file"),
    (openssh_private_key("enc", cipher="aes256-ctr"), "an unencrypted private key"),
    ("-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,00\n\nAAAA\n-----END RSA PRIVATE KEY-----",
     "an unencrypted private key"),
    ("-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----", "an unencrypted private key"),
    (KEY.replace("\n", " "), "with its line breaks"),
    ("-----BEGIN KEY-----\nPRIVATEKEYBODY\n-----END KEY-----\n", "an SSH private key ('-----BEGIN OPENSSH"),
    (KEY.replace(KEY.splitlines()[1], KEY.splitlines()[1][:-3] + "!!!"), "decodes"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\n" + b64(b"not-openssh-at-all-but-long-enough") + "\n-----END OPENSSH PRIVATE KEY-----",
     "starts with 'openssh-key-v1'"),
    ("-----BEGIN DSA PRIVATE KEY-----\nMIIBuwIBAAKBgQ\n-----END DSA PRIVATE KEY-----", "refuse DSA keys"),
    ("hunter2", "an SSH private key"),
]  # fmt: skip


@pytest.mark.parametrize(("value", "expected"), BAD_PRIVATE_KEYS)
def test_an_ssh_private_key_that_is_no_usable_private_key_is_refused_without_showing_it(value, expected):
    problem = only_problem(config(sshPrivateKey=value), "sshPrivateKey")
    assert problem.startswith("sshPrivateKey: '[secret]' — ") and expected in problem


def test_an_openssh_private_key_passes():
    assert private_key_problem(KEY) is None
    load_cluster_config(config(sshPrivateKey=KEY))


# --- 6. promotion from itself ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prod", "organization/prod", "organization/spark-vllm/prod"])
def test_a_stack_promoting_from_itself_is_refused(name):
    raw = config(image=None, model=None, promoteFrom=name)
    del raw["image"], raw["model"]
    problem = only_problem(raw, "promoteFrom", this_stack="organization/spark-vllm/prod")
    assert "another stack than this one (organization/spark-vllm/prod)" in problem
    assert "organization/spark-vllm/staging" in problem


@pytest.mark.parametrize("name", ["staging", "organization/spark-vllm/staging", "acme/spark-vllm/prod", "other/prod-2"])
def test_promoting_from_another_stack_passes(name):
    raw = config(promoteFrom=name)
    del raw["image"], raw["model"]
    load_cluster_config(raw, this_stack="organization/spark-vllm/prod")


# --- 7. a typo in the namespace ----------------------------------------------------------------------

NEAR_MISSES = ["spark_vllm", "sparkvllm", "Spark-vLLM", "spark-vlm", "sprak-vllm", "spark.vllm", "spark-vllm2",
               "spark-llm", "SPARK_VLLM", "spark–vllm"]  # fmt: skip
OTHER_NAMESPACES = ["docker", "command", "pulumi", "aws", "vllm", "spark", "kubernetes", "spark-ray"]


@pytest.mark.parametrize("namespace", NEAR_MISSES)
def test_a_near_miss_of_the_namespace_is_refused_with_the_fix(namespace):
    problem = only_problem(config(), f"{namespace}:maxModelLen", foreign={f"{namespace}:maxModelLen": "4096"})
    assert f"{namespace!r} is not 'spark-vllm'" in problem
    assert "pulumi config set --path spark-vllm:maxModelLen" in problem


@pytest.mark.parametrize("namespace", OTHER_NAMESPACES)
def test_other_namespaces_stay_allowed(namespace):
    assert not near_namespace(namespace)
    load_cluster_config(config(), foreign={f"{namespace}:x": "1"})


def test_a_misspelt_secret_is_listed_without_its_value():
    foreign = {"spark_vllm:apiKey": "sk-live-9", "spark_vllm:token": "t-live-9"}
    problems = problems_of(config(), foreign=foreign, foreign_secret={"spark_vllm:token"})
    assert len(problems) == 2 and not any("live-9" in p for p in problems)
    assert "pulumi config set --secret --path spark-vllm:apiKey" in problems[0]


def test_every_class_is_listed_in_one_error():
    raw = config(
        apiKey="",
        model="/models/../x",
        vllm__extraArgs=["--tensor_parallel=2"],
        nodes__1__fabricAddress="127.0.0.1",
        nodes__0__hostKey="ssh-ed25519 AAAA",
        promoteFrom="prod",
    )
    del raw["image"]
    problems = problems_of(raw, this_stack="organization/spark-vllm/prod", foreign={"spark_vllm:model": "x"})
    paths = {re.split(r": ", p, maxsplit=1)[0] for p in problems}
    assert {"apiKey", "model", "vllm.extraArgs[0]", "nodes[1].fabricAddress", "nodes[0].hostKey", "promoteFrom",
            "spark_vllm:model"} <= paths, problems  # fmt: skip
