# What the scripts that report from a node share (hf_download.py, image_pull.py and node_fabric_copy.py import it):
# their voice, `[node] message` (node_log.speak_with), and sizes for people. Standard library only, no side effects.


def node_voice(node):
    """How a script that reports from `node` speaks (node_log.speak_with): `[node] message`."""
    return lambda message: print(f"[{node}] {message}", flush=True)


def human(count):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000.0
