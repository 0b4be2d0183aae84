# vLLM's compile cache without this node's secrets (the supervisor's): vLLM 0.25 hashes every VLLM_* variable into
# its torch.compile key and writes their raw values in cache_key_factors.json beside the compiled graphs. Standard
# library only.
import glob
import json
import os

SECRET_ENV = ("VLLM_API_KEY", "HF_TOKEN", "RAY_AUTH_TOKEN")
COMPILE_FACTORS = "torch_compile_cache/*/*/*/cache_key_factors.json"
REDACTED = "<redacted by spark-vllm>"


def vllm_cache_root(env):
    """Where vLLM keeps its caches (vllm/envs.py VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, ~/.cache/vllm)."""
    if env.get("VLLM_CACHE_ROOT"):
        return os.path.expanduser(env["VLLM_CACHE_ROOT"])
    return os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")


def redact_compile_factors(env, seen):
    """Secrets of `env` out of vLLM's cache_key_factors.json files (those not in `seen`, path -> (mtime, size));
    returns the paths changed."""
    secrets = [env[name] for name in SECRET_ENV if len(env.get(name) or "") >= 8]
    changed = []
    for path in glob.glob(os.path.join(vllm_cache_root(env), COMPILE_FACTORS)):
        try:
            # size too: a file read between its creation and vLLM's write can keep its mtime (the
            # kernel's timestamps are coarse), and would then be skipped with the key in it
            stat = os.stat(path)
            if seen.get(path) == (stat.st_mtime_ns, stat.st_size):
                continue
            with open(path) as handle:
                text = handle.read()
            cleaned = text
            for secret in secrets:
                cleaned = cleaned.replace(json.dumps(secret)[1:-1], REDACTED)
            if cleaned != text:
                with open(f"{path}.tmp", "w") as handle:
                    handle.write(cleaned)
                os.chmod(f"{path}.tmp", os.stat(path).st_mode & 0o777)
                os.replace(f"{path}.tmp", path)
                changed.append(path)
            stat = os.stat(path)
            seen[path] = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            continue  # written this moment, or removed: looked at again next time
    return changed
