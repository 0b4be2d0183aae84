# Runs on a node's HOST (its own python3, standard library only) as `python3 - MODEL_DIR` with this
# script on stdin (see components.preflight.fingerprint_argv). Prints one JSON line:
#   {"fingerprint": sha256 hex, "files": {relative path: size}, "metadata": {relative path: sha256},
#    "broken": [relative paths of dangling symlinks], "config": {the KV-relevant keys of config.json},
#    "weights": [the weight files vLLM loads, as vllm_weights.py decides]}
# ("config" and "weights" are not part of the fingerprint: the files and config.json already are.)
# The fingerprint covers every file's name and size plus the sha256 of the small metadata files
# (configs, tokenizer, chat template, remote code). Weights are only stat()ed, never read, so a
# 120 GB model takes milliseconds. Symlinks are followed (a Hugging Face snapshot is symlinks into
# ../../blobs); hidden files and directories (.cache/huggingface download state, .git) are skipped.
# Exit 1 with a message on stderr when MODEL_DIR is not a readable directory.
import hashlib
import json
import os
import sys

from components.scripts.node_contract import ModelFingerprint
from components.scripts.vllm_weights import index_files, loaded_weight_files

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx", ".npz")
METADATA_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".py", ".tiktoken", ".yaml", ".yml")
METADATA_MAX_BYTES = 50 * 1024 * 1024


def is_metadata(name, size):
    lower = name.lower()
    return lower.endswith(METADATA_SUFFIXES) and not lower.endswith(WEIGHT_SUFFIXES) and size < METADATA_MAX_BYTES


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def scan(root):
    files, metadata, broken = {}, {}, []
    seen_dirs = set()
    for current, dirs, names in os.walk(root, followlinks=True):
        info = os.stat(current)
        if (info.st_dev, info.st_ino) in seen_dirs:  # a symlink loop, or the same directory twice
            dirs[:] = []
            continue
        seen_dirs.add((info.st_dev, info.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = os.path.join(current, name)
            relative = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                info = os.stat(path)
            except OSError:
                broken.append(relative)
                continue
            files[relative] = info.st_size
            if is_metadata(name, info.st_size):
                metadata[relative] = sha256_of(path)
    return files, metadata, sorted(broken)


CONFIG_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "layer_types",
    "full_attention_interval",
    "max_position_embeddings",
    "mamba_ssm_dtype",
    "torch_dtype",
    "dtype",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "architectures",
    "model_type",
    "vocab_size",  # with speculative decoding: the rejection sampler's warm-up (components/memory.py)
    "mtp_num_hidden_layers",  # the MTP layers a checkpoint ships (components/speculation.py)
    "num_nextn_predict_layers",
    "num_mtp_modules",
)


def config_facts(root):
    """The keys of config.json the memory plan needs (text_config kept for multimodal models)."""
    try:
        with open(os.path.join(root, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    facts = {key: config[key] for key in CONFIG_KEYS if key in config}
    for nested in ("text_config", "llm_config"):
        if isinstance(config.get(nested), dict):
            facts[nested] = {key: config[nested][key] for key in CONFIG_KEYS if key in config[nested]}
    return facts


def main(argv):
    if len(argv) != 2:
        print("usage: python3 - MODEL_DIR", file=sys.stderr)
        return 2
    root = argv[1]
    if not os.path.isdir(root) or not os.access(root, os.R_OK | os.X_OK):
        print(f"model fingerprint: {root} is not a readable directory", file=sys.stderr)
        return 1
    try:
        files, metadata, broken = scan(root)
    except OSError as error:
        print(f"model fingerprint: cannot read {root}: {error}", file=sys.stderr)
        return 1
    body = {"files": files, "metadata": metadata, "broken": broken}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(canonical).hexdigest()

    def read_index(name):
        try:
            with open(os.path.join(root, name)) as handle:
                return index_files(handle.read())
        except OSError:
            return None

    weights = loaded_weight_files(files, read_index)
    facts = ModelFingerprint(fingerprint=digest, **body, config=config_facts(root), weights=weights)
    print(json.dumps(facts.to_json(), sort_keys=True))
    return 0


sys.exit(main(sys.argv))
