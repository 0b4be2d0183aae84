"""The plugin side of Pulumi's provider protocol, for the rehearsal's stand-in providers.

A Pulumi resource provider is a program the engine starts (`pulumi-resource-<name> ENGINE_ADDRESS`)
that serves `pulumirpc.ResourceProvider` over gRPC and prints its port on stdout. This module is
that server plus the property plumbing every provider needs: Struct ⇄ Python values with secrets and
unknowns kept in place, detailed diffs with property paths, and logging to the engine (streamed
lines show in `pulumi up`'s progress display, as the real providers' do).

Each stand-in (tests/e2e/providers/docker.py, command.py) supplies one `Resource` handler per
resource type; the engine, its state, its plans and its display are the real CLI's.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
from google.protobuf import empty_pb2, struct_pb2


def _protocol_modules() -> None:
    """Make `pulumi.runtime.proto` (the generated protocol modules, which import only protobuf and grpc)
    importable without running the `pulumi` and `pulumi.runtime` packages' __init__: those load the whole
    program SDK (0.1-0.2 s of CPU), which a provider never uses, and the engine starts a provider process for
    every provider of every command (about 250 in one run of the suite). Only in a provider's own process (its
    main module is one of tests/e2e/providers'): a test importing this module keeps the real packages."""
    import importlib.util
    import types

    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if "pulumi" in sys.modules or main is None or not main.name.startswith("tests.e2e.providers."):
        return
    base = importlib.util.find_spec("pulumi").submodule_search_locations[0]
    for name, folder in (("pulumi", base), ("pulumi.runtime", os.path.join(base, "runtime"))):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package


_protocol_modules()
from pulumi.runtime.proto import engine_pb2, engine_pb2_grpc, plugin_pb2, provider_pb2, provider_pb2_grpc  # noqa: E402

UNKNOWN_WIRE = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"  # how the engine spells "not known yet"
SIG_KEY = "4dabf18193072939515e22adb298388d"
SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"


class _Unknown:
    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()


@dataclass(frozen=True)
class Secret:
    """A value the engine marked secret; kept wrapped so outputs echo it back as a secret."""

    value: Any


# --- values ----------------------------------------------------------------------------------------


def from_struct(struct: Optional[struct_pb2.Struct]) -> dict[str, Any]:
    if struct is None:
        return {}
    return {key: _from_value(value) for key, value in struct.fields.items()}


def _from_value(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        inner = {key: _from_value(v) for key, v in value.struct_value.fields.items()}
        if inner.get(SIG_KEY) == SECRET_SIG:
            return Secret(inner.get("value"))
        return inner
    if kind == "list_value":
        return [_from_value(v) for v in value.list_value.values]
    if kind == "string_value":
        return UNKNOWN if value.string_value == UNKNOWN_WIRE else value.string_value
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() else number
    if kind == "bool_value":
        return value.bool_value
    return None


def to_struct(values: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    for key, value in values.items():
        struct.fields[key].CopyFrom(_to_value(value))
    return struct


def _to_value(value: Any) -> struct_pb2.Value:
    out = struct_pb2.Value()
    if isinstance(value, Secret):
        out.struct_value.CopyFrom(to_struct({SIG_KEY: SECRET_SIG, "value": value.value}))
    elif value is UNKNOWN:
        out.string_value = UNKNOWN_WIRE
    elif isinstance(value, dict):
        out.struct_value.CopyFrom(to_struct(value))
    elif isinstance(value, (list, tuple)):
        out.list_value.values.extend(_to_value(v) for v in value)
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, (int, float)):
        out.number_value = float(value)
    elif isinstance(value, str):
        out.string_value = value
    else:
        out.null_value = struct_pb2.NULL_VALUE
    return out


def reveal(value: Any) -> Any:
    """The plain value, secrets unwrapped (unknowns stay UNKNOWN)."""
    if isinstance(value, Secret):
        return reveal(value.value)
    if isinstance(value, dict):
        return {key: reveal(v) for key, v in value.items()}
    if isinstance(value, list):
        return [reveal(v) for v in value]
    return value


def has_unknown(value: Any) -> bool:
    value = reveal(value)
    if value is UNKNOWN:
        return True
    if isinstance(value, dict):
        return any(has_unknown(v) for v in value.values())
    if isinstance(value, list):
        return any(has_unknown(v) for v in value)
    return False


# --- diffs -----------------------------------------------------------------------------------------

ADD, ADD_REPLACE, DELETE, DELETE_REPLACE, UPDATE, UPDATE_REPLACE = range(6)
_REPLACING = {ADD: ADD_REPLACE, DELETE: DELETE_REPLACE, UPDATE: UPDATE_REPLACE}


def _path(prefix: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)


def property_diffs(old: Any, new: Any, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(path, kind) for every leaf that differs, in the engine's path syntax (`triggers[0]`, `a.b`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if key not in old or old[key] is None:
                if new.get(key) is not None:
                    yield _path(prefix, key), ADD
            elif key not in new or new[key] is None:
                yield _path(prefix, key), DELETE
            else:
                yield from property_diffs(old[key], new[key], _path(prefix, key))
    elif isinstance(old, list) and isinstance(new, list):
        for index in range(max(len(old), len(new))):
            if index >= len(old):
                yield _path(prefix, index), ADD
            elif index >= len(new):
                yield _path(prefix, index), DELETE
            else:
                yield from property_diffs(old[index], new[index], _path(prefix, index))
    elif old != new or new is UNKNOWN:
        yield prefix, UPDATE


def top_key(path: str) -> str:
    return path.split(".", 1)[0].split("[", 1)[0]


def diff_response(
    old: dict[str, Any],
    new: dict[str, Any],
    replace_keys: Callable[[str, str, int], bool] = lambda key, path, kind: False,
    delete_before_replace: bool = False,
    ignore: tuple[str, ...] = (),
) -> provider_pb2.DiffResponse:
    """A DiffResponse between old and new inputs. `replace_keys(top key, path, kind)` says which
    changes force a replacement, as the real provider's schema would."""
    old = {k: v for k, v in reveal(old).items() if k not in ignore and not k.startswith("__")}
    new = {k: v for k, v in reveal(new).items() if k not in ignore and not k.startswith("__")}
    detailed: dict[str, provider_pb2.PropertyDiff] = {}
    diffs: list[str] = []
    replaces: list[str] = []
    for path, kind in property_diffs(old, new):
        key = top_key(path)
        if replace_keys(key, path, kind):
            kind = _REPLACING.get(kind, kind)
            if key not in replaces:
                replaces.append(key)
        if key not in diffs:
            diffs.append(key)
        detailed[path] = provider_pb2.PropertyDiff(kind=kind, inputDiff=True)
    return provider_pb2.DiffResponse(
        changes=provider_pb2.DiffResponse.DIFF_SOME if diffs else provider_pb2.DiffResponse.DIFF_NONE,
        diffs=diffs,
        replaces=replaces,
        detailedDiff=detailed,
        hasDetailedDiff=True,
        deleteBeforeReplace=delete_before_replace and bool(replaces),
    )


# --- the server ------------------------------------------------------------------------------------


class ProviderError(Exception):
    """An operation failed; the message is what `pulumi up` prints for the resource."""


@dataclass
class Call:
    """What one resource operation knows besides its properties: who it is and how to talk back."""

    urn: str
    engine: Optional[EngineLog]
    config: dict[str, Any]
    timeout: float = 0.0
    preview: bool = False

    @property
    def name(self) -> str:
        return self.urn.rsplit("::", 1)[-1]

    def status(self, message: str) -> None:
        """A line in the progress display next to the resource (the real providers' InfoStatus)."""
        if self.engine:
            self.engine.log(engine_pb2.INFO, message, self.urn, ephemeral=True)

    def info(self, message: str) -> None:
        if self.engine:
            self.engine.log(engine_pb2.INFO, message, self.urn, ephemeral=False)

    def warn(self, message: str) -> None:
        if self.engine:
            self.engine.log(engine_pb2.WARNING, message, self.urn, ephemeral=False)

    def error(self, message: str) -> None:
        if self.engine:
            self.engine.log(engine_pb2.ERROR, message, self.urn, ephemeral=False)


class Resource:
    """One resource type. Properties arrive decoded (Secret/UNKNOWN kept); return plain dicts."""

    def check(self, call: Call, olds: dict, news: dict) -> tuple[dict, list[tuple[str, str]]]:
        return news, []

    def diff(self, call: Call, id_: str, old_inputs: dict, olds: dict, news: dict) -> provider_pb2.DiffResponse:
        return diff_response(old_inputs, news)

    def create(self, call: Call, news: dict) -> tuple[str, dict]:
        raise NotImplementedError

    def read(self, call: Call, id_: str, olds: dict, inputs: dict) -> tuple[str, dict, dict]:
        return id_, olds, inputs

    def update(self, call: Call, id_: str, olds: dict, news: dict, old_inputs: dict) -> dict:
        raise NotImplementedError

    def delete(self, call: Call, id_: str, olds: dict, old_inputs: dict) -> None:
        return None


def unique_id(name: str) -> str:
    """`name` + 8 random hex digits, the id scheme of pulumi-go-provider resources."""
    return f"{name}{secrets.token_hex(4)}"


class EngineLog:
    def __init__(self, address: str):
        self._stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(address))
        self._lock = threading.Lock()

    def log(self, severity: int, message: str, urn: str, ephemeral: bool) -> None:
        try:
            with self._lock:
                self._stub.Log(engine_pb2.LogRequest(severity=severity, message=message, urn=urn, ephemeral=ephemeral))
        except grpc.RpcError:
            pass  # the engine is going away; logging is best effort


@dataclass
class Provider:
    """A stand-in provider: its package name, the version it stands in for, its resource types and
    how it validates its own config (`check_config` returns failures as (property, reason))."""

    name: str
    version: str
    resources: dict[str, Resource]
    check_config: Callable[[dict], list[tuple[str, str]]] = lambda config: []
    diff_config: Callable[[dict, dict], provider_pb2.DiffResponse] = lambda old, new: diff_response(old, new)
    config: dict[str, Any] = field(default_factory=dict)


def _handled(method):
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ProviderError as error:
            context.abort(grpc.StatusCode.UNKNOWN, str(error))
        except Exception:  # noqa: BLE001 - a bug in the stand-in must reach the user, not hang the engine
            context.abort(grpc.StatusCode.INTERNAL, traceback.format_exc())

    return wrapper


class _Servicer(provider_pb2_grpc.ResourceProviderServicer):
    def __init__(self, provider: Provider, engine: Optional[EngineLog]):
        self.provider = provider
        self.engine = engine

    def _call(self, request, preview: bool = False) -> Call:
        timeout = float(getattr(request, "timeout", 0) or 0)
        return Call(urn=request.urn, engine=self.engine, config=self.provider.config, timeout=timeout, preview=preview)

    def _resource(self, urn: str) -> Resource:
        typ = urn.split("::")[2].split("$")[-1]
        handler = self.provider.resources.get(typ)
        if handler is None:
            raise ProviderError(f"the stand-in {self.provider.name} provider does not implement {typ}")
        return handler

    def GetPluginInfo(self, request, context):  # noqa: N802 - gRPC method names
        return plugin_pb2.PluginInfo(version=self.provider.version)

    @_handled
    def CheckConfig(self, request, context):  # noqa: N802
        news = from_struct(request.news)
        failures = self.provider.check_config(news)
        return provider_pb2.CheckResponse(
            inputs=to_struct(news),
            failures=[provider_pb2.CheckFailure(property=p, reason=r) for p, r in failures],
        )

    @_handled
    def DiffConfig(self, request, context):  # noqa: N802
        old = from_struct(request.old_inputs) or from_struct(request.olds)
        return self.provider.diff_config(old, from_struct(request.news))

    @_handled
    def Configure(self, request, context):  # noqa: N802
        config = from_struct(request.args) if request.HasField("args") else dict(request.variables)
        self.provider.config.update({key.rsplit(":", 1)[-1]: value for key, value in config.items()})
        return provider_pb2.ConfigureResponse(acceptSecrets=True, supportsPreview=True, acceptResources=True)

    @_handled
    def Check(self, request, context):  # noqa: N802
        inputs, failures = self._resource(request.urn).check(
            self._call(request), from_struct(request.olds), from_struct(request.news)
        )
        return provider_pb2.CheckResponse(
            inputs=to_struct(inputs),
            failures=[provider_pb2.CheckFailure(property=p, reason=r) for p, r in failures],
        )

    @_handled
    def Diff(self, request, context):  # noqa: N802
        olds = from_struct(request.olds)
        old_inputs = from_struct(request.old_inputs) if request.HasField("old_inputs") else olds
        return self._resource(request.urn).diff(
            self._call(request), request.id, old_inputs, olds, from_struct(request.news)
        )

    @_handled
    def Create(self, request, context):  # noqa: N802
        id_, outputs = self._resource(request.urn).create(
            self._call(request, request.preview), from_struct(request.properties)
        )
        return provider_pb2.CreateResponse(id=id_, properties=to_struct(outputs))

    @_handled
    def Read(self, request, context):  # noqa: N802
        id_, outputs, inputs = self._resource(request.urn).read(
            self._call(request), request.id, from_struct(request.properties), from_struct(request.inputs)
        )
        if not id_:
            return provider_pb2.ReadResponse()  # gone: the engine drops it from the state
        return provider_pb2.ReadResponse(id=id_, properties=to_struct(outputs), inputs=to_struct(inputs))

    @_handled
    def Update(self, request, context):  # noqa: N802
        olds = from_struct(request.olds)
        old_inputs = from_struct(request.old_inputs) if request.HasField("old_inputs") else olds
        outputs = self._resource(request.urn).update(
            self._call(request, request.preview), request.id, olds, from_struct(request.news), old_inputs
        )
        return provider_pb2.UpdateResponse(properties=to_struct(outputs))

    @_handled
    def Delete(self, request, context):  # noqa: N802
        olds = from_struct(request.properties)
        old_inputs = from_struct(request.old_inputs) if request.HasField("old_inputs") else olds
        self._resource(request.urn).delete(self._call(request), request.id, olds, old_inputs)
        return empty_pb2.Empty()

    def Cancel(self, request, context):  # noqa: N802
        return empty_pb2.Empty()

    def GetSchema(self, request, context):  # noqa: N802
        return provider_pb2.GetSchemaResponse(schema=json.dumps({"name": self.provider.name}))


def serve(provider: Provider, argv: Optional[list[str]] = None) -> None:
    """Run as the engine starts a plugin: `pulumi-resource-NAME ENGINE_ADDRESS [flags]`."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    engine = EngineLog(args[0]) if args else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    provider_pb2_grpc.add_ResourceProviderServicer_to_server(_Servicer(provider, engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # The engine reads the port from our first line of stdout; nothing else may be printed there.
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    # The engine stops plugins with a signal when it is done: leave quietly, as a Go plugin does.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: os._exit(0))
    server.wait_for_termination()
