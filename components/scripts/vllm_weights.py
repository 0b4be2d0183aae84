# Which weight files vLLM loads from a model directory: imported by the
# scripts that need it (model_fingerprint.py on the node, hf_download.py in the image), and by
# components.preflight. Standard library only, no side effects.
#
# vLLM 0.25's default loader (vllm/model_executor/model_loader/default_loader.py, _prepare_weights, with
# load_format auto): Mistral's consolidated*.safetensors when there are any; otherwise the first of
# *.safetensors, *.bin, *.pt that matches, globbed in the model directory itself (a subdirectory such
# as Llama's original/ is never read); safetensors are then filtered by their index's weight_map
# (model.safetensors.index.json) when there is one (weight_utils.py filter_duplicate_safetensors_files),
# the others lose training state (filter_files_not_needed_for_inference).
import fnmatch

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
TRAINING_STATE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def loaded_weight_files(names, read_index):
    """The files vLLM reads of a model whose files are `names` (paths relative to the model directory);
    `read_index(name)` returns the file names an index's weight_map lists (or None when unreadable)."""
    top = sorted(name for name in names if "/" not in name and not name.startswith("."))
    files = [name for name in top if fnmatch.fnmatch(name, "consolidated*.safetensors")]
    index = "consolidated.safetensors.index.json"
    if not files:
        index = "model.safetensors.index.json"
        for pattern in WEIGHT_PATTERNS:
            files = [name for name in top if fnmatch.fnmatch(name, pattern)]
            if files:
                break
    if files and files[0].endswith(".safetensors"):
        listed = read_index(index) if index in top else None
        if listed is not None:
            files = [name for name in files if name in listed]
    else:
        files = [name for name in files if not name.endswith(TRAINING_STATE)]
    return files


def index_files(text):
    """The file names a safetensors index's weight_map lists, from its JSON text (None when unreadable)."""
    import json

    try:
        return set(json.loads(text)["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
