"""The parameters a node program was sent with (components/plan/programs.py `script_program`): inside the program
text on stdin, never in argv or the remote environment. The loader (node_loader.py) puts them here before the
program's entry script runs; the entry reads them once, through its contract (node_contract.py)."""

import json

TEXT = None  # the JSON text the program carries, as the loader found it


def given():
    """The program's parameters, as a dict."""
    if TEXT is None:
        raise RuntimeError("no parameters: node programs run as components.plan.programs.script_program makes them")
    return json.loads(TEXT)
