# A Hugging Face repo downloaded once, on the copy source, into the host's Hugging Face cache
# (container.hfCacheDir, mounted at P.hf_home in a throwaway container of the node's image, which
# has huggingface_hub as vLLM does); modelSync then copies it to the other nodes over the fabric.
# A repo already complete in the cache downloads nothing. Prints progress every progress_seconds and
# one JSON line at the end: repo, revision, the snapshot's path on the host, files, bytes, seconds.
# The token (hfToken) travels in this program on stdin, never on a command line.
import json
import os
import sys
import threading
import time

from components.scripts.node_common import human, node_voice
from components.scripts.node_contract import HfDownloaded, HfDownloadParams
from components.scripts.node_log import say, speak_with
from components.scripts.node_params import given
from components.scripts.vllm_weights import index_files, loaded_weight_files

P = HfDownloadParams.from_json(given())
speak_with(node_voice(P.node))
os.environ["HF_HOME"] = P.hf_home
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
if P.endpoint:
    os.environ["HF_ENDPOINT"] = P.endpoint
if P.token:
    os.environ["HF_TOKEN"] = P.token


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx", ".npz")


def repo_dir():
    return os.path.join(P.hf_home, "hub", "models--" + P.repo.replace("/", "--"))


def size_of(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def report(done, started):
    while not done.wait(P.progress_seconds):
        elapsed = time.monotonic() - started
        size = size_of(repo_dir())
        say(f"downloading {P.repo}: {human(size)} in the cache after {elapsed:.0f} s")


def main():
    try:
        from huggingface_hub import HfApi, hf_hub_download, snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError as error:
        say(f"the image has no huggingface_hub ({error}): download the model to a directory and set model to it")
        return 1
    started = time.monotonic()
    before = size_of(repo_dir())
    done = threading.Event()
    threading.Thread(target=report, args=(done, started), daemon=True).start()
    say(f"downloading {P.repo} into the Hugging Face cache ({P.host_cache})")
    try:
        info = HfApi().model_info(P.repo)
        names = [sibling.rfilename for sibling in info.siblings or []]

        def read_index(name):
            try:
                with open(hf_hub_download(P.repo, name, revision=info.sha)) as handle:
                    return index_files(handle.read())
            except (OSError, ValueError):
                return None

        # Only the weights vLLM loads: not a .bin copy beside the safetensors, not Llama's original/.
        weights = set(loaded_weight_files(names, read_index))
        wanted = [name for name in names if name in weights or not name.lower().endswith(WEIGHT_SUFFIXES)]
        left_out = sorted(set(names) - set(wanted))
        if left_out:
            shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
            say(f"leaving out {len(left_out)} weight file(s) vLLM does not load: {shown}")
        # No revision: huggingface_hub writes refs/main only for a branch name, and vLLM offline
        # (HF_HUB_OFFLINE=1 on every node) finds the snapshot through refs/main.
        snapshot = snapshot_download(P.repo, allow_patterns=wanted)
    except GatedRepoError:
        say(f"{P.repo} is gated or private: set hfToken (`pulumi config set --secret hfToken …`) to a token "
            "that has been granted access")  # fmt: skip
        return 1
    except RepositoryNotFoundError:
        say(f"no repository {P.repo} on {os.environ.get('HF_ENDPOINT', 'huggingface.co')} (or it is private)")
        return 1
    except Exception as error:  # noqa: BLE001 - the hub's and the network's errors, named for the user
        say(f"the download failed: {type(error).__name__}: {error}")
        return 1
    finally:
        done.set()
    seconds = time.monotonic() - started
    size = size_of(repo_dir())
    files = sum(len(names) for _, _, names in os.walk(snapshot))
    revision = os.path.basename(snapshot.rstrip("/"))
    host_snapshot = P.host_cache + snapshot[len(P.hf_home) :]
    fetched = size - before
    say(f"{P.repo} at {revision[:12]}: {files} files, {human(size)}; downloaded {human(fetched)} in {seconds:.1f} s")
    done = HfDownloaded(repo=P.repo, revision=revision, snapshot=host_snapshot, files=files, bytes=size,
                        downloaded_bytes=fetched, seconds=round(seconds, 2))  # fmt: skip
    print(json.dumps(done.to_json()))
    return 0


sys.exit(main())
