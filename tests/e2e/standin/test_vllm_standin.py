"""Unit tests of the vLLM stand-in's pure parts (no Ray, no Docker needed)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from vllm_standin import api, args, cli, core  # noqa: E402

from tests.waiting import free_port, holds_for, wait_for, wait_until  # noqa: E402


def serve_ns(*argv: str):
    return args.parse_cli(["serve", *argv])


# -- command line ---------------------------------------------------------------


def test_parses_real_vllm_spellings():
    ns = serve_ns(
        "Qwen/Qwen3-0.6B",
        "--tensor-parallel-size",
        "2",
        "-pp",
        "1",
        "--data-parallel-size",
        "1",
        "--distributed-executor-backend",
        "ray",
        "--gpu-memory-utilization",
        "0.85",
        "--max-model-len",
        "32k",
        "--max-num-seqs",
        "8",
        "--kv-cache-dtype",
        "fp8",
        "--quantization",
        "fp8",
        "--load-format",
        "safetensors",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--served-model-name",
        "a",
        "b",
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "qwen3_coder",
        "--api-key",
        "k",
        "--enforce-eager",
        "--trust-remote-code",
        "--enable-auto-tool-choice",
        "--no-enable-prefix-caching",
    )
    assert ns.tensor_parallel_size == 2 and ns.pipeline_parallel_size == 1
    assert ns.distributed_executor_backend == "ray"
    assert ns.gpu_memory_utilization == 0.85
    assert ns.max_model_len == 32000
    assert ns.served_model_name == ["a", "b"]
    assert ns.trust_remote_code is True and ns.enable_auto_tool_choice is True
    assert ns.enable_prefix_caching is False and ns.enforce_eager is True
    cfg = args.validate(ns, environ={})
    assert cfg.world_size == 2 and cfg.served_model_names == ("a", "b") and cfg.port == 8001


def test_short_tp_and_underscore_spelling():
    ns = serve_ns("m", "-tp", "4", "--max_model_len=8192")
    assert ns.tensor_parallel_size == 4 and ns.max_model_len == 8192


def test_defaults():
    ns = serve_ns("m")
    cfg = args.validate(ns, environ={})
    assert (cfg.host, cfg.port, cfg.max_model_len, cfg.backend, cfg.api_key) == ("0.0.0.0", 8000, 4096, None, None)
    assert ns.enable_prefix_caching is None and ns.trust_remote_code is False


@pytest.mark.parametrize("bad", [["--tensor-parallel", "2"], ["--no-such-flag"], ["--nccl-debug", "INFO"]])
def test_unknown_and_abbreviated_flags_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as e:
        serve_ns("m", *bad)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bad_choice_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        serve_ns("m", "--distributed-executor-backend", "slurm")
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_process_rejects_unknown_flag():
    r = subprocess.run(
        [sys.executable, "-m", "vllm_standin", "serve", "m", "--bogus"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


@pytest.mark.parametrize(
    "text,value",
    [
        ("4096", 4096),
        ("32k", 32000),
        ("32K", 32768),
        ("25.6k", 25600),
        ("1M", 2**20),
        ("1m", 10**6),
        ("auto", -1),
        ("AUTO", -1),
        ("-1", -1),
    ],
)
def test_max_model_len_forms(text, value):
    assert args.human_readable_int_or_auto(text) == value


@pytest.mark.parametrize("text", ["1.5K", "abc", "32kk"])
def test_max_model_len_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        args.human_readable_int_or_auto(text)


def test_resolved_max_model_len():
    assert args.resolve_max_model_len(None) == 4096
    assert args.resolve_max_model_len(-1) == 4096
    assert args.resolve_max_model_len(32768) == 32768
    assert args.validate(serve_ns("m", "--max-model-len", "32K"), environ={}).max_model_len == 32768


def test_auto_tool_choice_requires_parser():
    with pytest.raises(args.StandinError, match="requires --tool-call-parser"):
        args.validate(serve_ns("m", "--enable-auto-tool-choice"), environ={})


def test_unknown_parser_names_fail():
    with pytest.raises(args.StandinError, match="invalid tool call parser"):
        args.validate(serve_ns("m", "--tool-call-parser", "qwen3-coder"), environ={})
    with pytest.raises(args.StandinError, match="invalid reasoning parser"):
        args.validate(serve_ns("m", "--reasoning-parser", "qwen"), environ={})


def test_model_path_needs_config_json(tmp_path):
    with pytest.raises(args.StandinError, match="config.json"):
        args.validate(serve_ns(str(tmp_path)), environ={})
    with pytest.raises(args.StandinError, match="Invalid repository ID or local directory"):
        args.validate(serve_ns(str(tmp_path / "missing")), environ={})
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 6}))
    assert args.validate(serve_ns(str(tmp_path)), environ={}).model == str(tmp_path)
    with pytest.raises(args.StandinError, match="divisible by tensor parallel size"):
        args.validate(serve_ns(str(tmp_path), "-tp", "4"), environ={})


def test_cli_exit_1_on_missing_model_dir(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path / "nope")], environ={}) == 1
    assert "Invalid repository ID or local directory" in capsys.readouterr().out


def test_cli_world_above_local_gpus_needs_ray(capsys):
    assert cli.main(["serve", "m", "--tensor-parallel-size", "2"], environ={}) == 1
    assert "--distributed-executor-backend ray" in capsys.readouterr().out


def test_api_key_source():
    assert args.validate(serve_ns("m"), environ={"VLLM_API_KEY": "env"}).api_key == "env"
    assert args.validate(serve_ns("m", "--api-key", "cli"), environ={"VLLM_API_KEY": "env"}).api_key == "cli"
    assert args.validate(serve_ns("m"), environ={"VLLM_API_KEY": ""}).api_key is None


def test_args_log_hides_key():
    assert args.redacted_args(serve_ns("m", "--api-key", "s3cret"))["api_key"] == "<redacted>"


# -- API ------------------------------------------------------------------------------


def test_auth_guards_v1_v2_and_inference_only_as_vllm_0_25_does():
    assert api.is_authorized("/v1/models", None, None)
    assert not api.is_authorized("/v1/models", None, "k")
    assert not api.is_authorized("/v1/models", "Bearer x", "k")
    assert api.is_authorized("/v1/models", "Bearer k", "k")
    for guarded in ("/v2/rerank", "/inference/v1/generate", "/v1x"):
        assert not api.is_authorized(guarded, None, "k"), guarded
    for p in ("/health", "/version", "/metrics", "/ping", "/invocations", "/tokenize", "/detokenize", "/pooling"):
        assert api.is_authorized(p, None, "k")
    assert api.is_authorized("/v1/chat/completions", None, "k", method="OPTIONS")  # never checked


def _post(port: int, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


@pytest.mark.parametrize("dev", [False, True])
def test_what_vllm_serves_without_its_key_the_standin_serves_too(tmp_path, dev):
    """The hole the edge closes (REFERENCE.md, "Who gets in without a key"): with --api-key set, a completion
    through /invocations, tokenize and detokenize answer anyone, and in dev mode the operational routes."""
    http = free_port()
    process = serve_one(
        tmp_path, http, extra=("--api-key", "sk-standin"), environ={"VLLM_SERVER_DEV_MODE": "1"} if dev else None
    )
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert _post(http, "/v1/chat/completions", chat)[0] == 401
        status, answer = _post(http, "/invocations", {**chat, "model": str(tmp_path / "model")})
        assert status == 200 and answer["object"] == "chat.completion", answer
        status, answer = _post(
            http, "/invocations", {"model": str(tmp_path / "model"), "prompt": "a b", "max_tokens": 2}
        )
        assert status == 200 and answer["object"] == "text_completion", answer
        status, tokens = _post(http, "/tokenize", {"prompt": "one two three"})
        assert status == 200 and tokens["count"] == 3
        assert _post(http, "/detokenize", {"tokens": tokens["tokens"]})[0] == 200
        assert _post(http, "/pooling", {"input": "x"})[0] == 404  # a generative model mounts no pooling route
        assert _post(http, "/reset_prefix_cache", {})[0] == (200 if dev else 404)
        assert _post(http, "/v2/rerank", {})[0] == 401
    finally:
        end(process)


def cfg(**kw):
    base = dict(
        model="/models/m",
        served_model_names=("m",),
        max_model_len=4096,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        backend=None,
        host="127.0.0.1",
        port=0,
        api_key=None,
    )
    base.update(kw)
    return args.ServeConfig(**base)


def test_chat_reply_is_deterministic():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"}]
    assert api.chat_reply(msgs) == "standin reply: three two one"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a b"}]}]
    assert api.chat_reply(parts) == "standin reply: b a"


def test_chat_completion_usage_and_truncation():
    body = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}
    status, r = api.chat_completion(body, cfg(), 0)
    assert status == 200
    assert r["choices"][0]["message"]["content"] == "standin reply: three two one"
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert r["choices"][0]["finish_reason"] == "stop"
    status, r2 = api.chat_completion(dict(body, max_tokens=2), cfg(), 0)
    assert r2["choices"][0]["message"]["content"] == "standin reply:"
    assert r2["choices"][0]["finish_reason"] == "length" and r2["usage"]["completion_tokens"] == 2
    assert api.chat_completion(body, cfg(), 0)[1]["id"] == r["id"]


def test_chat_completion_errors():
    status, r = api.chat_completion({"model": "other", "messages": [{"role": "user", "content": "x"}]}, cfg(), 0)
    assert status == 404 and r["error"]["type"] == "NotFoundError"
    assert api.chat_completion({"model": "m"}, cfg(), 0)[0] == 400
    status, r = api.chat_completion(
        {"model": "m", "messages": [{"role": "user", "content": "x y"}], "max_tokens": 10}, cfg(max_model_len=5), 0
    )
    assert status == 400 and "maximum context length is 5" in r["error"]["message"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                     "days": {"type": "integer"}}, "required": ["city", "unit"]}}}  # fmt: skip


def test_a_named_or_required_tool_choice_makes_a_tool_call_of_the_functions_schema():
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    status, r = api.chat_completion(body, cfg(), 0)
    message = r["choices"][0]["message"]
    assert status == 200 and message["content"] == "" and r["choices"][0]["finish_reason"] == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "standin", "unit": "c"}
    status, r = api.chat_completion(dict(body, tool_choice="required"), cfg(), 0)
    assert r["choices"][0]["finish_reason"] == "tool_calls" and r["choices"][0]["message"]["tool_calls"]
    chunks = api.stream_chunks(r, False)
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"])


def test_auto_tool_choice_needs_the_flags_as_vllm_says():
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
    status, r = api.chat_completion(body, cfg(), 0)
    assert status == 400 and '"auto" tool choice requires --enable-auto-tool-choice' in r["error"]["message"]
    status, r = api.chat_completion(body, cfg(auto_tool_choice=True), 0)
    assert status == 200 and r["choices"][0]["message"]["tool_calls"] == []  # words: the stand-in calls nothing
    status, r = api.chat_completion(
        dict(body, tool_choice={"type": "function", "function": {"name": "nope"}}), cfg(), 0
    )
    assert status == 400 and "Tool 'nope' has not been passed" in r["error"]["message"]


def test_chat_render_gives_the_prompts_token_ids_as_vllm_does_and_refuses_what_chat_refuses():
    """vLLM 0.25's POST /v1/chat/completions/render (scale_out/render/api_router.py): a GenerateRequest,
    `token_ids` the rendered prompt; what vllm-router's cache_aware policy asks of a replica."""
    body = {"model": "m", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}
    status, r = api.render_chat(body, cfg(vocab_size=1000))
    assert status == 200 and r["model"] == "m" and r["sampling_params"] == {"max_tokens": 4}
    assert len(r["token_ids"]) == 4 and all(0 <= t < 1000 for t in r["token_ids"])  # role marker + 3 words
    assert api.render_chat(body, cfg(vocab_size=1000)) == (status, r)  # the same prompt, the same tokens
    assert api.render_chat(dict(body, model="other"), cfg())[0] == 404
    assert api.render_chat({"model": "m"}, cfg())[0] == 400


def test_models_payload():
    p = api.models_payload(cfg(served_model_names=("a", "b"), max_model_len=32768), 1)
    assert [m["id"] for m in p["data"]] == ["a", "b"]
    assert all(m["root"] == "/models/m" and m["max_model_len"] == 32768 and m["owned_by"] == "vllm" for m in p["data"])


def test_the_server_binds_without_asking_the_resolver_as_uvicorn_does(monkeypatch):
    """http.server's bind looks its address's name up (socket.getfqdn); vLLM's uvicorn does not. A name server that
    never answers (the simulated nodes' until 2026-12-07) held every start of the stand-in 10 s."""
    import socket

    def no_lookup(*_args):
        raise AssertionError("the resolver was asked")

    monkeypatch.setattr(socket, "getfqdn", no_lookup)
    server = api.make_server(api.ServerState(cfg()))
    try:
        assert server.server_address[1] > 0
    finally:
        server.server_close()


def test_http_server_end_to_end():
    state = api.ServerState(cfg(api_key="k"))
    server = api.make_server(state)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{port}"

    def call(path, body=None, key=None):
        req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        assert call("/health") == (200, b"")
        assert json.loads(call("/version")[1]) == {"version": "0.25.0"}  # the release it plays by default
        assert b"vllm:num_requests_running" in call("/metrics")[1]
        status, body = call("/v1/models")
        assert status == 401 and json.loads(body) == {"error": "Unauthorized"}
        status, body = call("/v1/models", key="k")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hello world"}]}
        assert call("/v1/chat/completions", chat)[0] == 401
        status, body = call("/v1/chat/completions", chat, key="k")
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "standin reply: world hello"
        status, body = call("/v1/chat/completions", dict(chat, stream=True), key="k")
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        state.engine_alive = False
        assert call("/health")[0] == 503
    finally:
        server.shutdown()
        server.server_close()


# -- the multi-node mp executor (two processes on this machine's loopback addresses) ---------------


def mp_rank(tmp_path, rank, nnodes, master_port, http_port, ip, master="127.0.0.1", extra=(), timeout="20"):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["StandinForCausalLM"]}')
    argv = [sys.executable, "-m", "vllm_standin", "serve", str(model), "--tensor-parallel-size", str(nnodes),
            "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", master, "--master-port",
            str(master_port), "--host", "127.0.0.1", "--port", str(http_port), *extra]  # fmt: skip
    if rank:
        argv.append("--headless")
    env = {"PATH": "/usr/bin:/bin", "VLLM_HOST_IP": ip, "STANDIN_LOAD_SECONDS": "0.2", "STANDIN_JOIN_TIMEOUT_S": timeout,
           "STANDIN_DEAD_LINGER_S": "0.2", "STANDIN_PING_TIMEOUT_S": "1",
           "STANDIN_GPU_DIR": str(tmp_path / f"gpus-of-{ip}"),  # each "node" its own GPU
           "VLLM_CACHE_ROOT": str(tmp_path / f"vllm-cache-of-{ip}"), "VLLM_API_KEY": "k" * 16}  # fmt: skip
    log = open(tmp_path / f"rank{rank}.log", "w")
    # Its own session, so a test ends a rank as a node going away does: the whole group.
    return subprocess.Popen(
        argv, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def end(process) -> None:
    """A rank and whatever it started (its engine core outlives a SIGKILL of the rank alone)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_mp_rank_0_serves_only_once_every_rank_joined_and_dies_with_a_rank(tmp_path):
    master, http = free_port(), free_port()
    head = mp_rank(tmp_path, 0, 2, master, http, "127.0.0.1")
    try:
        assert not wait_for(lambda: health(http) == 200, timeout=1.5)  # waits for rank 1
        worker = mp_rank(tmp_path, 1, 2, master, http, "127.0.0.2")
        assert wait_for(lambda: health(http) == 200, 60)
        log = (tmp_path / "rank0.log").read_text()
        assert "node rank 1 joined from 127.0.0.1 (VLLM_HOST_IP 127.0.0.2)" in log
        # what vLLM 0.25 leaves beside its compiled graphs: the raw VLLM_* values it hashed, the key among them
        for ip, rank in (("127.0.0.1", 0), ("127.0.0.2", 1)):
            [factors] = (tmp_path / f"vllm-cache-of-{ip}" / "torch_compile_cache").glob(
                f"*/rank_{rank}_0/backbone/cache_key_factors.json"
            )
            found = json.loads(factors.read_text())["env"]
            assert found["VLLM_API_KEY"] == "k" * 16 and "VLLM_HOST_IP" not in found
        os.killpg(worker.pid, signal.SIGKILL)  # the whole rank, engine core included
        worker.wait()
        assert head.wait(timeout=60) == 1  # a rank went away: the engine is dead
        assert "EngineCore encountered a fatal error: a worker node died" in (tmp_path / "rank0.log").read_text()
    finally:
        for process in (head,):
            end(process)


def test_mp_a_worker_exits_when_rank_0_goes_away(tmp_path):
    master, http = free_port(), free_port()
    head = mp_rank(tmp_path, 0, 2, master, http, "127.0.0.1")
    worker = mp_rank(tmp_path, 1, 2, master, http, "127.0.0.2")
    try:
        assert wait_for(lambda: health(http) == 200, 60)  # bounds, not timings: the fast lane runs 6 at once on 2 cores
        head.terminate()
        assert head.wait(timeout=60) == 0
        assert worker.wait(timeout=60) == 1
        assert "lost rank 0" in (tmp_path / "rank1.log").read_text()
    finally:
        for process in (head, worker):
            end(process)


def test_mp_a_worker_with_a_wrong_master_address_never_joins(tmp_path):
    master, http = free_port(), free_port()
    head = mp_rank(tmp_path, 0, 2, master, http, "127.0.0.1", timeout="2")
    worker = mp_rank(tmp_path, 1, 2, master, http, "127.0.0.2", master="127.0.0.3", timeout="2")
    try:
        assert head.wait(timeout=60) == 1
        assert "waiting for node ranks [1]" in (tmp_path / "rank0.log").read_text()
        assert worker.wait(timeout=60) == 1
        assert "could not reach rank 0 at 127.0.0.3" in (tmp_path / "rank1.log").read_text()
    finally:
        for process in (head, worker):
            end(process)


def test_mp_a_duplicate_rank_is_refused(tmp_path):
    master, http = free_port(), free_port()
    head = mp_rank(tmp_path, 0, 3, master, http, "127.0.0.1", timeout="4")
    one = mp_rank(tmp_path, 1, 3, master, http, "127.0.0.2", timeout="4")
    try:
        assert wait_for(lambda: "node rank 1 joined" in (tmp_path / "rank0.log").read_text(), 60)
        again = subprocess.run(
            [sys.executable, "-m", "vllm_standin", "serve", str(tmp_path / "model"), "-tp", "3", "--nnodes", "3",
             "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(master), "--headless"],
            cwd=HERE, env={"PATH": "/usr/bin:/bin", "VLLM_HOST_IP": "127.0.0.4", "STANDIN_GPU_DIR": str(tmp_path / "gpus-4")},
            capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert again.returncode == 1 and "rank 0 refused node rank 1" in again.stdout + again.stderr
        assert head.wait(timeout=60) == 1  # rank 2 never came (a bound: the fast lane runs 6 at once on 2 cores)
    finally:
        for process in (head, one):
            end(process)


def test_mp_rank_0_must_bind_its_own_address(tmp_path):
    master, http = free_port(), free_port()
    head = mp_rank(tmp_path, 0, 2, master, http, "127.0.0.1", master="192.0.2.1")
    assert head.wait(timeout=60) == 1
    assert "The server socket has failed to bind to 192.0.2.1" in (tmp_path / "rank0.log").read_text()


def test_offline_a_repo_id_must_be_in_the_hugging_face_cache(tmp_path):
    environ = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    with pytest.raises(args.StandinError, match="couldn't find them in the cached files"):
        args.check_model("org/tiny", environ)
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"architectures": ["StandinForCausalLM"]}')
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc")
    assert args.check_model("org/tiny", environ) == {"architectures": ["StandinForCausalLM"]}
    assert args.check_model("org/elsewhere", {}) == {}  # online: vLLM would download it


# -- the engine core: a second process that holds the GPU, as in real vLLM ---------------------------


def serve_one(tmp_path, http_port, name="serve", extra=(), environ=None):
    """`vllm serve` of one GPU (uniprocessor executor), in a session of its own as the supervisor starts it."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["StandinForCausalLM"]}')
    argv = [sys.executable, "-m", "vllm_standin", "serve", str(model), "--host", "127.0.0.1", "--port",
            str(http_port), *extra]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "STANDIN_LOAD_SECONDS": "0.2", "STANDIN_DEAD_LINGER_S": "0.2",
           "STANDIN_GPU_DIR": str(tmp_path / "gpus"), "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
           "STANDIN_COMPILE_SECONDS": "0.3", **(environ or {})}  # fmt: skip
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        argv, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def kv_gib(log_path) -> float | None:
    """The KV cache the stand-in's log says it took (either of vLLM 0.25's two lines)."""
    text = Path(log_path).read_text()
    found = re.search(r"Available KV cache memory: (-?[\d.]+) GiB", text) or re.search(
        r"reserved ([\d.]+) GiB memory for KV Cache", text
    )
    return float(found.group(1)) if found else None


def sparse_model(tmp_path, name: str, weights_gib: float):
    """A model directory whose weight file has the real size without taking the disk (the lane's models do this)."""
    model = tmp_path / name
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["StandinForCausalLM"]}')
    with open(model / "model.safetensors", "wb") as handle:
        handle.truncate(int(weights_gib * 1024**3))
    return model


def serve_beside(tmp_path, name: str, model, utilization: float, extra=(), profile_s: float = 1.5):
    """One of several vLLMs of one node: the same GPU (STANDIN_GPU_DIR), each its own port."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_standin", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--gpu-memory-utilization", str(utilization), *extra]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "STANDIN_LOAD_SECONDS": "0.5", "STANDIN_PROFILE_SECONDS": str(profile_s),
           "STANDIN_GPU_DIR": str(tmp_path / "gpus"), "VLLM_CACHE_ROOT": str(tmp_path / f"cache-{name}"),
           "STANDIN_COMPILE_SECONDS": "0.1", "STANDIN_DEAD_LINGER_S": "0.2"}  # fmt: skip
    log = open(tmp_path / f"{name}.log", "w")
    process = subprocess.Popen(argv, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return process, port


def test_two_vllms_profiling_at_once_on_one_gpu_count_each_others_memory(tmp_path):
    """vLLM issue 55827, as the H200 showed it (2026-12-03, a Qwen3-8B shape at 0.30 and a Qwen3-30B-A3B shape at
    0.55 started together): the small one refused, and the big one took more than its share.

    The order is held by the GPU's ledger, not by timing: the big one starts once the small one profiles (its
    weights and activation held), lands its weights within the small one's 5 s of profiling and profiles for
    9 s, well after the small one has refused and let go (a CI run beside a busy core once saw the small one's
    exit come after a 1.5 s profile's end)."""
    gpu = core.GpuShare(0, {"STANDIN_GPU_DIR": str(tmp_path / "gpus")})
    small, _ = serve_beside(tmp_path, "small", sparse_model(tmp_path, "qwen3-8b", 15.3), 0.3, profile_s=5)
    wait_until(lambda: gpu.others() == pytest.approx(16.3), 30, "the small one profiling: 15.3 + 1 GiB held")
    big, big_port = serve_beside(tmp_path, "big", sparse_model(tmp_path, "qwen3-30b", 57), 0.55, profile_s=9)
    try:
        assert small.wait(timeout=60) == 1  # the big one's weights landed while it profiled
        assert "No available memory for the cache blocks" in (tmp_path / "small.log").read_text()
        assert wait_for(lambda: health(big_port) == 200, 90)
        # its share is 0.55 x 139.8 - 57 - 1 = 18.89 GiB; the small one's 16.3 GiB, gone meanwhile, counted as its own
        assert kv_gib(tmp_path / "big.log") == pytest.approx(18.89 + 16.3, abs=0.05)
    finally:
        end(small)
        end(big)


def test_with_the_kv_cache_in_bytes_each_vllm_gets_what_it_asked_for_beside_the_other(tmp_path):
    model = sparse_model(tmp_path, "model", 15.3)
    pinned = ["--kv-cache-memory-bytes", str(24 * 1024**3)]
    started = [serve_beside(tmp_path, name, model, 0.3, pinned) for name in ("a", "b")]
    try:
        for _, port in started:
            assert wait_for(lambda port=port: health(port) == 200, 90)
        for name in ("a", "b"):
            assert kv_gib(tmp_path / f"{name}.log") == 24.0
            assert "skipped memory profiling" in (tmp_path / f"{name}.log").read_text()
        held = sorted(json.loads(p.read_text())["gib"] for p in (tmp_path / "gpus" / "gpu0").glob("*.json"))
        assert held == [pytest.approx(40.3, abs=0.01)] * 2  # weights + activations + KV each, in the GPU's ledger
    finally:
        for process, _ in started:
            end(process)
    gpu = core.GpuShare(0, {"STANDIN_GPU_DIR": str(tmp_path / "gpus")})
    assert wait_for(lambda: gpu.others() == 0, 90)  # their memory gone with them, killed or stopped


def test_a_neighbour_that_lets_go_of_its_memory_while_one_profiles_trips_vllms_assert(tmp_path):
    model = sparse_model(tmp_path, "model", 8)
    neighbour, port = serve_beside(tmp_path, "neighbour", model, 0.3, ["--kv-cache-memory-bytes", "20g"])
    assert wait_for(lambda: health(port) == 200, 90)
    starting, _ = serve_beside(tmp_path, "starting", model, 0.3)
    wait_until(lambda: "Model loading took" in (tmp_path / "starting.log").read_text(), 30,
               "the second vLLM to load its weights and start profiling")  # fmt: skip
    end(neighbour)
    assert starting.wait(timeout=30) == 1
    assert "AssertionError: Error in memory profiling. Initial free memory" in (tmp_path / "starting.log").read_text()


def group_of(pid: int) -> list[int]:
    """The live processes of `pid`'s process group, other than it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid:
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z" and int(stat[2]) == pid:
                found.append(int(entry))
    return found


def test_the_engine_core_is_another_process_of_the_group_that_outlives_a_sigkilled_api_server(tmp_path):
    http = free_port()
    first = serve_one(tmp_path, http)
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        (core,) = group_of(first.pid)
        assert Path(f"/proc/{core}/comm").read_text().strip() == "VLLM::EngineCor"
        assert "serve" not in Path(f"/proc/{core}/cmdline").read_text()  # not found by `pgrep -f "vllm serve"`
        first.kill()  # only the API server, as the OOM killer or a crash does
        first.wait()
        holds_for(lambda: group_of(first.pid) == [core], 1, "the engine core living on, holding the GPU")
        second = serve_one(tmp_path, free_port(), name="second")
        assert second.wait(timeout=30) == 1
        out = (tmp_path / "second.log").read_text()
        assert re.search(
            r"ValueError: Free memory on device cuda:0 \(\d+\.\d/139\.8 GiB\) on startup is less than desired GPU "
            r"memory utilization \(0\.9, 125\.82 GiB\)",
            out,
        ), out
        assert "Engine core initialization failed" in out
        os.killpg(first.pid, signal.SIGKILL)  # what the supervisor does: the whole group
        assert wait_for(lambda: not group_of(first.pid), 90)
        third = serve_one(tmp_path, http, name="third")
        assert wait_for(lambda: health(http) == 200, 60)  # the GPU is free again
        end(third)
    finally:
        end(first)


def test_a_graph_in_the_compile_cache_is_loaded_and_a_missing_one_compiled(tmp_path):
    """What a kept ~/.cache/vllm (a Docker volume) changes for a new container: vLLM's own log says it."""
    http = free_port()
    compiled = "Compiling a graph for compile range (1, 8192) takes"
    loaded = "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took"
    # the model's settings are part of the key (ModelConfig.compute_hash): another max_model_len compiles
    for name, extra, expected in (("cold", (), compiled), ("warm", (), loaded),
                                  ("other-len", ("--max-model-len", "1024"), compiled)):  # fmt: skip
        process = serve_one(tmp_path, http, name=name, extra=extra)
        try:
            assert wait_for(lambda: health(http) == 200, 60)
        finally:
            end(process)
        out = (tmp_path / f"{name}.log").read_text()
        assert expected in out, out
        assert f"Using cache directory: {tmp_path / 'vllm-cache' / 'torch_compile_cache'}/" in out
        assert out.count("compile range") == 1, out


def test_a_sigterm_ends_the_api_server_and_its_engine_core(tmp_path):
    http = free_port()
    process = serve_one(tmp_path, http)
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        (core,) = group_of(process.pid)
        process.terminate()
        assert process.wait(timeout=60) == 0
        assert wait_for(lambda: not group_of(process.pid), 90)
        again = serve_one(tmp_path, http, name="again")
        assert wait_for(lambda: health(http) == 200, 60)
        end(again)
    finally:
        end(process)


def test_an_engine_core_that_dies_takes_the_api_server_with_it(tmp_path):
    http = free_port()
    process = serve_one(tmp_path, http)
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        (core,) = group_of(process.pid)
        os.kill(core, signal.SIGKILL)
        assert process.wait(timeout=60) == 1
        assert "Engine core proc EngineCore_DP0 died unexpectedly" in (tmp_path / "serve.log").read_text()
    finally:
        end(process)


def test_with_a_reasoning_parser_a_short_answer_is_all_reasoning_as_vllm_0_25_gives_it():
    """Qwen3.5's chat template opens <think> in the prompt: 16 tokens never reach the answer."""
    body = {"messages": [{"role": "user", "content": "Reply with the single word: ready"}], "max_tokens": 16}
    status, answer = api.chat_completion(body, cfg(reasoning_parser="qwen3"), 1)
    message = answer["choices"][0]["message"]
    assert status == 200 and message["content"] is None and message["reasoning"].startswith("Okay, the user")
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 16
    status, long = api.chat_completion({**body, "max_tokens": 200}, cfg(reasoning_parser="qwen3"), 1)
    assert long["choices"][0]["message"]["content"] == "standin reply: ready word: single the with Reply"
    plain = api.chat_completion(body, cfg(), 1)[1]["choices"][0]["message"]
    assert plain["content"].startswith("standin reply:") and plain["reasoning"] is None


# -- /v1/completions, the pace of generation, /metrics --------------------------------------------


def test_completion_of_token_ids_with_ignore_eos_gives_exactly_max_tokens():
    status, answer = api.completion({"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}, cfg(), 1)
    assert status == 200 and answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 40, "total_tokens": 43}
    assert answer["choices"][0]["finish_reason"] == "length" and answer["object"] == "text_completion"
    status, short = api.completion({"prompt": "two words"}, cfg(), 1)
    assert (
        short["choices"][0]["text"] == " standin completion: words two"
        and short["choices"][0]["finish_reason"] == "stop"
    )
    assert api.completion({"prompt": " ".join(["w"] * 30)}, cfg(), 1)[1]["usage"]["completion_tokens"] == 16


def test_completion_refuses_what_vllm_refuses():
    vocab = cfg(vocab_size=1000)
    status, answer = api.completion({"prompt": [1, 1000]}, vocab, 1)
    assert status == 400 and answer["error"]["message"] == "Token id 1000 is out of vocabulary"
    assert api.completion({"prompt": [999]}, vocab, 1)[0] == 200
    assert api.completion({"prompt": [1], "max_tokens": 0}, vocab, 1)[0] == 400
    assert api.completion({"prompt": [1] * 10, "max_tokens": 4096}, cfg(max_model_len=4096), 1)[0] == 400
    assert api.completion({"prompt": {"no": 1}}, vocab, 1)[0] == 400
    assert api.completion({"prompt": [1], "model": "other"}, vocab, 1)[0] == 404


def test_token_delays_follow_the_pace():
    pace = api.Pace(tokens_per_second=50, prefill_tokens_per_second=1000)
    result = api.completion({"prompt": [1] * 100, "max_tokens": 4, "ignore_eos": True}, cfg(), 1)[1]
    chunks = api.completion_stream_chunks(result, include_usage=True)
    delays = api.token_delays(chunks, 100, pace)
    assert delays == pytest.approx([0.1 + 0.02, 0.02, 0.02, 0.02, 0.0])
    chat = api.chat_completion({"messages": [{"role": "user", "content": "a b"}]}, cfg(), 1)[1]
    chat_delays = api.token_delays(api.stream_chunks(chat, include_usage=False), 2, pace)
    # the role chunk is the first token's (what vllm bench serve times), then one step per word, the finish at once
    assert chat_delays == pytest.approx([0.002 + 0.02, 0.02, 0.02, 0.02, 0.02, 0.0])


def test_streaming_sends_each_token_when_it_is_generated_and_metrics_count_it():
    state = api.ServerState(cfg(), api.Pace(tokens_per_second=20, prefill_tokens_per_second=1e6))
    server = api.make_server(state)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = {"prompt": [1, 2], "max_tokens": 10, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/v1/completions",
                                         data=json.dumps(body).encode())  # fmt: skip
        start, arrivals, usage = time.monotonic(), [], None
        with urllib.request.urlopen(request, timeout=10) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        arrivals.append(time.monotonic() - start)
                    usage = chunk.get("usage") or usage
        assert len(arrivals) == 10 and usage["completion_tokens"] == 10
        assert arrivals[0] >= 0.05 and arrivals[-1] - arrivals[0] >= 9 * 0.05 * 0.9  # spread out, not one burst
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics").read().decode()
        assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0' in metrics
        assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' in metrics
        assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0' in metrics
        assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 9.0' in metrics
    finally:
        server.shutdown()
        server.server_close()


def test_every_metric_the_stand_in_serves_is_one_real_vllm_serves_with_the_same_type():
    """Against vLLM 0.25.0's own /metrics, captured on the H200 (tests/gpu/results/2026-12-01)."""
    real = Path(__file__).resolve().parents[2] / "gpu" / "results" / "2026-12-01" / "vllm-0.25.0-metric-types.txt"
    types = dict(line.split()[2:4] for line in real.read_text().splitlines())
    state = api.ServerState(cfg())
    state.finished("length", 0.01, [0.005], 0.02)
    served = dict(line.split()[2:4] for line in state.metrics_text().splitlines() if line.startswith("# TYPE"))
    assert served and {name: types.get(name) for name in served} == served
    rows = state.metrics_text()
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0' in rows
    assert 'vllm:request_success_total{engine="0",finished_reason="repetition",model_name="m"} 0.0' in rows


# -- serving that stops while /health is green (issue #56) ---------------------------------------------------


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def streamed(port: int, body: dict, seen: list, key: str | None = None) -> threading.Thread:
    """A streamed chat completion in a thread: each content piece appended to `seen` as it comes."""

    def read():
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
                    if delta.get("content"):
                        seen.append(delta["content"])
        seen.append("[DONE]")

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


LONG_ANSWER = {"model": None, "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}]}


def test_a_stopped_engine_core_stalls_generation_mid_stream_while_health_stays_200(tmp_path):
    """vLLM's outputs come only from its engine core's steps: SIGSTOP it and the stream stops, the counters stop,
    /health (the API server's alone) stays 200; SIGCONT and it goes on."""
    http = free_port()
    process = serve_one(tmp_path, http, environ={"STANDIN_TOKENS_PER_SECOND": "20"})
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        (core,) = group_of(process.pid)
        seen = []
        streamed(http, {**LONG_ANSWER, "model": str(tmp_path / "model")}, seen)
        assert wait_for(lambda: len(seen) >= 3, 60)
        os.kill(core, signal.SIGSTOP)
        time.sleep(0.5)
        frozen = (len(seen), metric(http, "vllm:generation_tokens_total"), metric(http, "vllm:kv_cache_usage_perc"))
        holds_for(
            lambda: (len(seen), metric(http, "vllm:generation_tokens_total"), metric(http, "vllm:kv_cache_usage_perc"))
            == frozen and health(http) == 200,
            3, "a stalled engine: nothing moves, /health 200",
        )  # fmt: skip
        assert metric(http, "vllm:num_requests_running") == 1
        os.kill(core, signal.SIGCONT)
        assert wait_for(lambda: seen[-1:] == ["[DONE]"], 90)
        assert len(seen) > frozen[0] + 1
    finally:
        end(process)


def test_the_fault_file_hangs_the_engine_or_makes_it_answer_other_tokens(tmp_path):
    http = free_port()
    fault = tmp_path / "fault"
    process = serve_one(tmp_path, http, environ={"STANDIN_FAULT_FILE": str(fault), "STANDIN_TOKENS_PER_SECOND": "50"})
    model = str(tmp_path / "model")
    canary = {"model": model, "messages": [{"role": "user", "content": "count to three"}], "max_tokens": 8,
              "temperature": 0, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        status, right = post_json(http, "/v1/chat/completions", canary)
        assert status == 200
        choice = right["choices"][0]
        assert [entry["token"] for entry in choice["logprobs"]["content"]] == choice["message"]["content"].split()
        assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])
        fault.write_text("wrong")
        status, wrong = post_json(http, "/v1/chat/completions", canary)
        assert status == 200 and wrong["choices"][0]["token_ids"] != choice["token_ids"]
        assert len(wrong["choices"][0]["token_ids"]) == len(choice["token_ids"]) and health(http) == 200
        fault.write_text("hang")
        time.sleep(0.5)  # its last step ages past the stand-in's 0.25 s
        seen = []
        streamed(http, {**LONG_ANSWER, "model": model}, seen)
        holds_for(lambda: not seen and health(http) == 200, 2, "a hung engine: no token, /health 200")
        fault.write_text("")
        assert wait_for(lambda: seen[-1:] == ["[DONE]"], 90)
        status, again = post_json(http, "/v1/chat/completions", canary)
        assert again["choices"][0]["token_ids"] == choice["token_ids"]
    finally:
        end(process)


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    "extra, status, message",
    [
        ({"top_logprobs": 2}, 400, "when using `top_logprobs`, `logprobs` must be set to true."),
        ({"logprobs": True, "top_logprobs": -2}, 400, "`top_logprobs` must be a positive value or -1."),
        ({"logprobs": True, "top_logprobs": 21}, 400, "greater than max allowed: 20"),
        ({"logprobs": True, "top_logprobs": 0}, 200, None),
        ({"logprobs": True}, 200, None),
    ],
)
def test_logprobs_are_refused_where_vllm_refuses_them(extra, status, message):
    cfg = args.validate(serve_ns("m"), {})
    body = {"messages": [{"role": "user", "content": "hi there"}], **extra}
    found, result = api.chat_completion(body, cfg, 0)
    assert found == status
    if message:
        assert message in result["error"]["message"]
    else:
        assert [entry["top_logprobs"] for entry in result["choices"][0]["logprobs"]["content"]] == [[], [], [], []]


def test_a_long_prefill_moves_the_kv_cache_use_chunk_by_chunk(tmp_path):
    """As vLLM's chunked prefill: each chunk's blocks are taken as it is scheduled, so a prompt that takes long to
    prefill moves vllm:kv_cache_usage_perc all along, while no token (and no prompt token) is counted yet."""
    http = free_port()
    env = {"STANDIN_PREFILL_TOKENS_PER_SECOND": "400", "STANDIN_PREFILL_CHUNK_TOKENS": "100"}
    process = serve_one(tmp_path, http, environ=env)
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        seen = []
        prompt = {"model": str(tmp_path / "model"), "messages": [{"role": "user", "content": "x " * 1200}]}
        streamed(http, {**prompt, "max_tokens": 2}, seen)  # 3 s of prefill in 12 chunks
        readings = []
        for _ in range(8):
            time.sleep(0.25)
            readings.append((metric(http, "vllm:kv_cache_usage_perc"), metric(http, "vllm:prompt_tokens_total")))
        assert len({kv for kv, _ in readings}) >= 4, readings  # it moved, again and again
        assert all(prompt_tokens == 0 for _, prompt_tokens in readings) and not seen
        assert wait_for(lambda: seen[-1:] == ["[DONE]"], 90)
        assert metric(http, "vllm:prompt_tokens_total") == 1200
    finally:
        end(process)


def test_mp_a_stopped_rank_holds_every_step_of_rank_0_without_killing_it(tmp_path):
    """A rank stuck (here SIGSTOPped) is a collective waiting for good: rank 0's stream stops with /health 200
    and nothing exits; the rank back, it goes on."""
    master, http = free_port(), free_port()
    head = mp_rank(tmp_path, 0, 2, master, http, "127.0.0.1", extra=())
    worker = mp_rank(tmp_path, 1, 2, master, http, "127.0.0.2")
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        seen = []
        streamed(http, {**LONG_ANSWER, "model": str(tmp_path / "model")}, seen, key="k" * 16)
        assert wait_for(lambda: len(seen) >= 2, 60)
        os.killpg(worker.pid, signal.SIGSTOP)
        time.sleep(0.5)
        count = len(seen)
        holds_for(lambda: len(seen) == count and health(http) == 200 and head.poll() is None, 8,
                  "rank 0 waiting on a stopped rank")  # fmt: skip
        os.killpg(worker.pid, signal.SIGCONT)
        assert wait_for(lambda: seen[-1:] == ["[DONE]"], 90)
    finally:
        for process in (head, worker):
            end(process)


def test_a_request_reaching_a_stopped_engine_counts_in_load_not_in_the_engines_gauges(tmp_path):
    """vLLM's /load (--enable-server-load-tracking) counts what the API server holds; the scheduler's gauges come
    with the engine's steps, so a request that arrives at a stopped engine core shows in /load alone."""
    http = free_port()
    process = serve_one(tmp_path, http, extra=("--enable-server-load-tracking",))
    try:
        assert wait_for(lambda: health(http) == 200, 60)
        (core,) = group_of(process.pid)
        os.kill(core, signal.SIGSTOP)
        seen = []
        streamed(http, {"model": str(tmp_path / "model"), "messages": [{"role": "user", "content": "hi"}]}, seen)

        def load(port):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/load", timeout=5) as response:
                return json.loads(response.read())["server_load"]

        assert wait_for(lambda: load(http) == 1, 60)
        assert metric(http, "vllm:num_requests_running") == 0 and not seen  # the engine never saw it
        os.kill(core, signal.SIGCONT)
        assert wait_for(lambda: seen[-1:] == ["[DONE]"], 90)
        assert wait_for(lambda: load(http) == 0, 60)
    finally:
        end(process)
