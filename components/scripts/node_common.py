# What the scripts that report from a node share: prepended (components/plan/programs.py SCRIPT_HELPERS) to
# hf_download.py, image_pull.py and node_fabric_copy.py, which each still travel as one program. Each
# function reads the script's own P (its node_contract parameters) when called. Standard library only, no side effects.


def say(message):
    print(f"[{P.node}] {message}", flush=True)


def human(count):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000.0
