"""How a node program runs its modules. A program that reaches a node (`python3 -` over SSH or `docker exec -i`, or
the supervisor's file) is this loader, the sources of the components.scripts modules its entry script imports
(found from the imports themselves, components/plan/programs.py), and one call of `run`. The modules are imported as
the package's are here, each under its own name and file name (a traceback names the module and its line), so the
node needs nothing but the host's or the image's python3 (3.7 and later) and its standard library.

Every program pays this file's imports at its start: the finder is a plain class with the methods the import system
calls, not a subclass of importlib.abc's, whose import (importlib.resources and typing behind it) took 40 ms of each
start's ~160 on the suite's machine (2026-12-07)."""

import importlib
import importlib.util
import linecache
import sys
import traceback

PACKAGES = ("components", "components.scripts")


def file_name(module):
    return module.replace(".", "/") + ".py"


def compiled(source, module):
    """`source` as the code of `module`, its lines where a traceback looks for them (there is no file to read)."""
    name = file_name(module)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return compile(source, name, "exec", dont_inherit=True)


class NodeModules:
    """The modules a program carries (module name -> source), found before anything on the node's sys.path: a meta
    path finder and its loader (find_spec, create_module, exec_module: what the import system calls)."""

    def __init__(self, sources):
        self.sources = sources

    def find_spec(self, name, path=None, target=None):
        if name in self.sources:
            return importlib.util.spec_from_loader(name, self, origin=file_name(name))
        if name in PACKAGES:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module):
        source = self.sources.get(module.__name__)
        if source is None:  # components, components.scripts: packages with nothing of their own
            return
        module.__file__ = file_name(module.__name__)
        exec(compiled(source, module.__name__), module.__dict__)


def run(sources, entry, params=None):
    """`entry` (a module of `sources`) as the program's __main__, with `params` (JSON text) in node_params."""
    sys.meta_path.insert(0, NodeModules(sources))
    if params is not None and "components.scripts.node_params" in sources:
        node_params = importlib.import_module("components.scripts.node_params")
        node_params.TEXT = params
    namespace = {"__name__": "__main__", "__file__": file_name(entry), "__builtins__": __builtins__}
    try:
        exec(compiled(sources[entry], entry), namespace)
    except Exception:  # shown, and exit 1, as Python would (SystemExit and KeyboardInterrupt pass)
        traceback.print_exc()  # with each module's lines: Python's own display (before 3.13) reads them from files
        sys.exit(1)
