"""Command line of the stand-in: ``vllm serve MODEL [flags]`` with real vLLM's spellings.

Pure standard library. Differences from vLLM that matter to callers:
* abbreviations of long flags are rejected (``allow_abbrev=False``), so a
  misspelt flag fails here instead of being silently accepted;
* only the flags listed in ``build_parser`` exist; any other flag exits 2 with
  argparse's "unrecognized arguments", as real vLLM does for unknown flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass

from . import __version__, bench
from .versions import plays

PLAYED = plays()

# Default context length reported when --max-model-len is absent or "auto"
# (real vLLM derives it from the model config; the stand-in has no model).
DEFAULT_MAX_MODEL_LEN = 4096

EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# Names vLLM registers (union over recent releases). Real vLLM rejects unknown
# names at start-up; so does the stand-in, which catches typos like "qwen3-coder".
REASONING_PARSERS = frozenset(
    """deepseek_r1 deepseek_v3 ernie45 glm45 gpt_oss granite hunyuan_a13b kimi_k2
    minimax_m2 minimax_m2_append_think mistral olmo3 qwen3 seed_oss step3""".split()
)
TOOL_CALL_PARSERS = frozenset(
    """deepseek_v3 deepseek_v31 deepseek_v32 ernie45 functiongemma gigachat3 glm45
    glm47 granite granite-20b-fc hermes hunyuan_a13b internlm jamba kimi_k2
    llama3_json llama4_json llama4_pythonic longcat minimax minimax_m2 mistral
    olmo3 openai phi4_mini_json pythonic qwen3_coder qwen3_xml seed_oss step3
    xlam""".split()
)


class StandinError(Exception):
    """A start-up failure: message printed as vLLM would, then exit code 1."""


def human_readable_int(value: str) -> int:
    """vLLM's parser: ``1k`` -> 1000, ``1K`` -> 1024, ``25.6k`` -> 25600, ``4096`` -> 4096.

    Lower-case suffixes are decimal, upper-case binary (decimals not allowed
    with binary suffixes), exactly like ``vllm.utils.argparse_utils``.
    """
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        try:
            return int(number) * binary[suffix]
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. "
                f"Did you mean to use {number}{suffix.lower()} instead?"
            ) from e
    try:
        return int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid integer: {value!r}") from e


def human_readable_int_or_auto(value: str) -> int:
    """Like :func:`human_readable_int`; ``auto`` or ``-1`` give -1 (auto-detect)."""
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


def resolve_max_model_len(value: int | None) -> int:
    """The context length the server reports: the parsed value, or 4096 for auto/absent."""
    if value is None or value < 0:
        return DEFAULT_MAX_MODEL_LEN
    return value


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool | None, help: str) -> None:
    """A switch as the release played declares it: `--X` and `--no-X` (argparse's BooleanOptionalAction), and from
    0.33 `--disable-X` beside `--enable-X` (vllm/utils/argparse_utils.py:120-146 EnableDisableAction)."""
    action = p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)
    if PLAYED.disable_switches and name.startswith("--enable-"):
        p.add_argument("--disable-" + name.removeprefix("--enable-"), dest=action.dest, action="store_false")


def build_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="vllm", allow_abbrev=False, description="vLLM stand-in CLI (test double)")
    top.add_argument("-v", "--version", action="version", version=__version__)
    sub = top.add_subparsers(dest="subparser", metavar="{serve,bench}")
    sub.required = True
    bench.add_parser(sub)  # `vllm bench serve`: vLLM's serving benchmark (bench.py)
    p = sub.add_parser(
        "serve", prog="vllm serve", allow_abbrev=False, help="Start the (stand-in) OpenAI-compatible server."
    )
    p.add_argument("model_tag", nargs="?", default=None, help="model directory or repo id")
    p.add_argument("--model", default=None, help="deprecated: give the model as the positional argument")
    # parallelism
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None)
    # multi-node mp executor (vLLM >= 0.11.1): one `vllm serve` per node
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true", default=False)
    # model / cache
    # vllm/engine/arg_utils.py: --device-memory-utilization names it too from 0.31
    p.add_argument("--gpu-memory-utilization", *PLAYED.gpu_memory_aliases, type=float, default=0.9)
    p.add_argument("--max-model-len", type=human_readable_int_or_auto, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None)
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=4)
    p.add_argument("--download-dir", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--generation-config", default="auto")
    p.add_argument("--hf-overrides", default=None)
    p.add_argument("--compilation-config", "-O", default=None)
    # vllm/engine/arg_utils.py: the JSON is read at parse time (optional_type(json.loads)), so malformed
    # JSON is argparse's error (exit 2); `-sc` is its short form
    p.add_argument("--speculative-config", "-sc", type=json.loads, default=None)
    p.add_argument("--limit-mm-per-prompt", default=None)
    _bool_flag(p, "--trust-remote-code", False, "trust remote code from the hub")
    _bool_flag(p, "--enforce-eager", False, "disable CUDA graphs")
    _bool_flag(p, "--enable-prefix-caching", None, "prefix caching (on by default)")
    _bool_flag(p, "--enable-chunked-prefill", None, "chunked prefill")
    _bool_flag(p, "--disable-custom-all-reduce", False, "custom all-reduce off")
    _bool_flag(p, "--async-scheduling", None, "async scheduling")
    _bool_flag(p, "--disable-log-stats", False, "no stats logging")
    _bool_flag(p, "--enable-log-requests", False, "log requests")
    # frontend
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--tool-call-parser", default=None)
    _bool_flag(p, "--enable-auto-tool-choice", False, "auto tool choice (needs --tool-call-parser)")
    # vllm/entrypoints/openai/cli_args.py FrontendArgs: /load counts the requests the API server holds
    _bool_flag(p, "--enable-server-load-tracking", False, "server load tracking")
    if PLAYED.scale_out_flag:  # vllm/entrypoints/scale_out/factories.py: the render routes, from 0.30
        _bool_flag(p, "--enable-scale-out", False, "scale-out endpoints (render, derender, tokens)")
    p.add_argument(
        "--uvicorn-log-level", choices=("debug", "info", "warning", "error", "critical", "trace"), default="info"
    )
    return top


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser accepts ``--max_model_len`` for ``--max-model-len``."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            if "=" in a:
                key, val = a.split("=", 1)
                a = "--" + key[2:].replace("_", "-") + "=" + val
            else:
                a = "--" + a[2:].replace("_", "-")
        out.append(a)
    return out


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse ``serve MODEL ...`` (argv without the program name). Exits 2 on usage errors."""
    return build_parser().parse_args(normalize_argv(argv))


@dataclass(frozen=True)
class ServeConfig:
    model: str
    served_model_names: tuple[str, ...]
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    backend: str | None
    host: str
    port: int
    api_key: str | None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    headless: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = (
        None  # the KV cache in bytes: no memory profiling (vllm/v1/worker/gpu_worker.py)
    )
    weights_gib: float = 0.0  # the model's weight files, which "loading" takes of the GPU
    auto_tool_choice: bool = False  # --enable-auto-tool-choice (with its --tool-call-parser)
    load_tracking: bool = False  # --enable-server-load-tracking: /load counts the requests in the API server
    scale_out: bool = False  # --enable-scale-out (0.30 on): the render routes answer (versions.Played.render_refusal)
    reasoning_parser: str | None = None
    vocab_size: int | None = None  # config.json's, when the model has one: prompt token ids are checked against it
    speculative: dict | None = None  # --speculative-config as vLLM resolved it: {"method", "num_speculative_tokens"}

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def api_key_from(ns: argparse.Namespace, environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """``--api-key`` wins; otherwise ``VLLM_API_KEY``; empty means none."""
    key = ns.api_key if ns.api_key is not None else environ.get("VLLM_API_KEY")
    return key or None


def cached_snapshot(model: str, environ) -> str:
    """A repo id in offline mode (HF_HUB_OFFLINE=1): its snapshot in the Hugging Face cache, as
    huggingface_hub resolves it (refs/main → snapshots/<sha>), or the error vLLM then shows."""
    home = environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
    repo = os.path.join(home, "hub", "models--" + model.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            snapshot = os.path.join(repo, "snapshots", f.read().strip())
    except OSError:
        snapshot = ""
    if not snapshot or not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise StandinError(
            "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
            f"cached files. Checkout your internet connection or see how to run the library in offline mode "
            f"(HF_HUB_OFFLINE=1) for '{model}'."
        )
    return snapshot


def check_model(model: str, environ=os.environ) -> dict:
    """A path-like model must be a directory with config.json; returns the parsed config ({} for repo ids,
    which offline must be in the Hugging Face cache)."""
    if not (model.startswith("/") or model.startswith(".")):
        if environ.get("HF_HUB_OFFLINE") not in ("1", "true", "True", "ON", "YES"):
            return {}
        model = cached_snapshot(model, environ)
    cfg = os.path.join(model, "config.json")
    if not os.path.isdir(model) or not os.path.isfile(cfg):
        raise StandinError(
            f"Invalid repository ID or local directory specified: '{model}'.\n"
            "Please verify the following requirements:\n"
            "1. Provide a valid Hugging Face repository ID.\n"
            "2. Specify a local directory that contains a recognized configuration file.\n"
            "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
            "   - For Mistral models: ensure the presence of a 'params.json'."
        )
    try:
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise StandinError(f"Failed to load config.json of '{model}': {e}") from e
    if not isinstance(data, dict):
        raise StandinError(f"config.json of '{model}' is not a JSON object")
    return data


def validate(ns: argparse.Namespace, environ: dict[str, str] | os._Environ = os.environ) -> ServeConfig:
    """Checks real vLLM makes before loading anything; raises StandinError (exit 1)."""
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise StandinError(f"model given twice: positional '{ns.model_tag}' and --model '{ns.model}'")
    model = ns.model_tag or ns.model
    if not model:
        raise StandinError("vllm serve: no model given (vllm serve MODEL ...)")
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise StandinError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    if ns.tool_call_parser and ns.tool_call_parser not in TOOL_CALL_PARSERS:
        raise StandinError(
            f"invalid tool call parser: {ns.tool_call_parser} (chose from {{ {','.join(sorted(TOOL_CALL_PARSERS))} }})"
        )
    if ns.reasoning_parser and ns.reasoning_parser not in REASONING_PARSERS:
        raise StandinError(
            f"invalid reasoning parser: {ns.reasoning_parser} (chose from {{ {','.join(sorted(REASONING_PARSERS))} }})"
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(ns, name) < 1:
            raise StandinError(f"{name} must be >= 1, got {getattr(ns, name)}")
    if not (0 < ns.gpu_memory_utilization <= 1):
        raise StandinError(f"GPU memory utilization must be within (0, 1]. Got {ns.gpu_memory_utilization}.")
    if not (0 < ns.port < 65536):
        raise StandinError(f"invalid port {ns.port}")
    if ns.max_num_seqs is not None and ns.max_num_seqs < 1:
        raise StandinError(f"max_num_seqs must be >= 1, got {ns.max_num_seqs}")
    if ns.max_model_len is not None and ns.max_model_len == 0:
        raise StandinError("max_model_len must be positive")
    if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        raise StandinError(f"--node-rank must be in [0, --nnodes); got rank {ns.node_rank} of {ns.nnodes}")
    if ns.nnodes > 1:
        if ns.distributed_executor_backend not in (None, "mp"):
            raise StandinError(
                f"--nnodes > 1 is the multiprocessing executor's; got --distributed-executor-backend "
                f"{ns.distributed_executor_backend}"
            )
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size
        if world % ns.nnodes:
            raise StandinError(f"world size {world} (TP x PP) is not divisible by --nnodes {ns.nnodes}")
    if ns.headless and ns.node_rank == 0:
        raise StandinError("stand-in: rank 0 serves the API; --headless belongs on node ranks above 0")
    hf_config = check_model(model, environ)
    heads = hf_config.get("num_attention_heads")
    if isinstance(heads, int) and heads % ns.tensor_parallel_size:
        raise StandinError(
            f"Total number of attention heads ({heads}) must be divisible by "
            f"tensor parallel size ({ns.tensor_parallel_size})."
        )
    speculative = speculative_config(ns.speculative_config, hf_config)
    return ServeConfig(
        speculative=speculative,
        model=model,
        served_model_names=tuple(ns.served_model_name or [model]),
        max_model_len=resolve_max_model_len(ns.max_model_len),
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        data_parallel_size=ns.data_parallel_size,
        backend=ns.distributed_executor_backend,
        host=ns.host or "0.0.0.0",
        port=ns.port,
        api_key=api_key_from(ns, environ),
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        headless=ns.headless,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        weights_gib=weights_gib(model),
        auto_tool_choice=bool(ns.enable_auto_tool_choice),
        load_tracking=bool(ns.enable_server_load_tracking),
        scale_out=bool(getattr(ns, "enable_scale_out", False)),
        reasoning_parser=ns.reasoning_parser,
        vocab_size=hf_config.get("vocab_size") if isinstance(hf_config.get("vocab_size"), int) else None,
    )


# vllm/config/speculative.py SpeculativeMethod (the methods the stand-in takes; vLLM 0.25 has more)
SPECULATIVE_METHODS = ("mtp", "ngram")
# vllm/config/speculative.py hf_config_override: where each MTP family keeps its layer count (n_predict)
MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_modules")


def speculative_config(given: object, hf_config: dict) -> dict | None:
    """--speculative-config as vLLM 0.25 checks it before loading (vllm/config/speculative.py
    SpeculativeConfig: `num_speculative_tokens` Field(gt=0); `method` one of SpeculativeMethod; for mtp the
    draft is the target's own MTP layers, n_predict from the config, and "num_speculative_tokens:N must be
    divisible by n_predict=M" when N > M; a model without MTP layers has no draft architecture to resolve)."""
    if given is None:
        return None
    if not isinstance(given, dict):
        raise StandinError(f"speculative_config: Input should be a valid dictionary, got {given!r}")
    method = given.get("method")
    tokens = given.get("num_speculative_tokens")
    if method not in SPECULATIVE_METHODS:
        raise StandinError(f"stand-in: speculative method {method!r} is not simulated (only {SPECULATIVE_METHODS})")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0):
        raise StandinError(f"num_speculative_tokens: Input should be greater than 0, got {tokens!r}")
    if method == "mtp":
        text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
        n_predict = next((where[key] for where in (text, hf_config) for key in MTP_LAYER_KEYS
                          if isinstance(where.get(key), int) and where[key] > 0), None)  # fmt: skip
        if n_predict is None:
            # Stricter than what was seen: vLLM 0.25 with mtp on a model without MTP layers was not run (the
            # program refuses it before any start, components/plan/speculation.py); the stand-in refuses it too, with
            # the wording of vLLM's model registry for an architecture it has no class for.
            architectures = hf_config.get("architectures") or ["?"]
            raise StandinError(
                f"Model architectures ['{architectures[0]}MTP'] are not supported for now (the model has no MTP "
                "layers to draft with)"
            )
        if tokens is None:
            tokens = n_predict
        elif tokens > n_predict and tokens % n_predict != 0:
            raise StandinError(f"num_speculative_tokens:{tokens} must be divisible by n_predict={n_predict}")
    elif tokens is None:
        raise StandinError("num_speculative_tokens was provided but without speculative model.")
    return {"method": method, "num_speculative_tokens": tokens}


def weights_gib(model: str) -> float:
    """The size of a model directory's weight files (sparse files of the real size count as their size), GiB."""
    if not os.path.isdir(model):
        return 0.0
    total = 0
    for name in os.listdir(model):
        if name.endswith((".safetensors", ".bin")):
            try:
                total += os.path.getsize(os.path.join(model, name))
            except OSError:
                pass
    return total / 1024**3


def redacted_args(ns: argparse.Namespace) -> dict:
    """The parsed args for the start-up log line, with the API key hidden."""
    d = dict(vars(ns))
    if d.get("api_key"):
        d["api_key"] = "<redacted>"
    return d
