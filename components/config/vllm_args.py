"""`vllm.extraArgs` as vLLM's own parser reads them. Pure: no I/O, no pydantic.

vLLM 0.25's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py, `parse_args`) rewrites every
argument before argparse sees it:

* a `--` argument has `_` turned into `-` in its name, from after the `--` up to the first `.` and
  before any `=` (`--max_num_seqs=8` is `--max-num-seqs=8`);
* `-O3`, `-O=3` and `-O 3` become `--optimization-level 3`;
* a name with a `.` sets one key of a JSON flag (`--speculative-config.method mtp`,
  `-sc.num_speculative_tokens=3`, `--x.key+ a,b` for a list): the flag is the part before the first `.`;
* `--config FILE` splices the YAML file's keys in as flags (the program cannot see that file);

then Python's argparse, with `allow_abbrev` left on, takes any unique prefix of a long flag as the
flag (`--tensor-parallel` is `--tensor-parallel-size`), a prefix of a short one likewise (`-t` is
`-tp`), reads `-n4` as `-n 4` for a one-letter option, and reads an argument holding a space before
any `=` (`'--max-num-seqs 8'`) as a positional word, which `vllm serve` refuses at start.

`read_extra_args` applies those rules to say which flag each argument is for vLLM, so a flag the
program sets itself (or a secret) cannot slip in under another spelling, and so the memory plan
reads `--kv_cache_dtype=fp8` as vLLM does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from components.config.vllm_versions import CHANGES

# The flags the program sets from typed keys, with vLLM 0.25's short forms (vllm/engine/arg_utils.py
# add_cli_args; vllm/entrypoints/openai/cli_args.py). Each maps to the key that sets it. Booleans
# declared with argparse.BooleanOptionalAction also have a `--no-` form.
MANAGED_FLAGS: dict[str, str] = {
    "--tensor-parallel-size": "tensorParallelSize",
    "-tp": "tensorParallelSize",
    "--pipeline-parallel-size": "pipelineParallelSize",
    "-pp": "pipelineParallelSize",
    "--distributed-executor-backend": "executor",
    "--max-model-len": "maxModelLen",
    "--gpu-memory-utilization": "vllm.gpuMemoryUtilization",
    "--host": "vllm.host",
    "--port": "vllm.port",
    "--served-model-name": "vllm.servedModelName",
    "--enable-server-load-tracking": "vllm.stallSeconds",  # the stall rule reads /load
    "--no-enable-server-load-tracking": "vllm.stallSeconds",
    "--trust-remote-code": "vllm.trustRemoteCode",
    "--no-trust-remote-code": "vllm.trustRemoteCode",
    "--reasoning-parser": "vllm.reasoningParser",
    "--tool-call-parser": "vllm.toolCallParser",
    "--enable-auto-tool-choice": "vllm.enableAutoToolChoice",
    "--no-enable-auto-tool-choice": "vllm.enableAutoToolChoice",
    "--nnodes": "executor",
    "-n": "executor",
    "--node-rank": "executor",
    "-r": "executor",
    "--master-addr": "executor",
    "--master-port": "vllm.masterPort",
    "--headless": "executor",
    "--model": "model",
    # speculative decoding: the JSON flag, its short form, and the three flags vLLM 0.25 merges into it
    # (vllm/engine/arg_utils.py add_cli_args, create_speculative_config)
    "--speculative-config": "vllm.speculative",
    "-sc": "vllm.speculative",
    "--spec-method": "vllm.speculative",
    "--spec-model": "vllm.speculative",
    "--spec-tokens": "vllm.speculative",
}


def _later_spellings() -> dict[str, str]:
    """What later releases read as one of MANAGED_FLAGS (components/config/vllm_versions.py): `--disable-X` for
    every `--enable-X` (disable_switches, 0.33 on: EnableDisableAction) and the other names of a flag
    (gpu_memory_aliases, 0.31 on). extraArgs is checked before the image says which vLLM it holds, so a spelling
    any supported release reads as a flag the program sets is refused."""
    found: dict[str, str] = {}
    if any(change.value for change in CHANGES["disable_switches"]):
        for flag, key in MANAGED_FLAGS.items():
            if flag.startswith("--enable-"):
                found["--disable-" + flag.removeprefix("--enable-")] = key
    for change in CHANGES["gpu_memory_aliases"]:
        for alias in change.value:
            found[alias] = MANAGED_FLAGS["--gpu-memory-utilization"]
    return found


MANAGED_FLAGS.update(_later_spellings())
# Flags whose value is a secret: in extraArgs it would sit in plain text in the stack file, in
# `ps` on the node and in the release record. Each maps to the secret that carries it instead.
SECRET_FLAGS: dict[str, str] = {"--api-key": "apiKey", "--hf-token": "hfToken"}
# Flags no stack can use through extraArgs, and why.
REFUSED_FLAGS: dict[str, str] = {
    "--config": "a YAML file on the node whose keys vLLM splices in as flags: the program cannot check them "
    "(it could set the tensor-parallel size or an API key); put its settings in extraArgs or their own keys",
    "--help": "prints vLLM's help and exits instead of serving",
    "-h": "prints vLLM's help and exits instead of serving",
}
# Flags the program reads besides passing them on (the memory plan), in their long form.
READ_FLAGS = ("--kv-cache-dtype", "--max-num-seqs", "--quantization", "--language-model-only")
# Switches the memory plan reads: each spelling a supported release takes (`--no-` from argparse's
# BooleanOptionalAction; `--disable-` from 0.33's EnableDisableAction), and what it sets.
READ_SWITCHES: dict[str, dict[str, bool]] = {
    "prefix_caching": {"--enable-prefix-caching": True, "--no-enable-prefix-caching": False,
                       "--disable-prefix-caching": False},
}  # fmt: skip

_PROTECTED = {**MANAGED_FLAGS, **SECRET_FLAGS}
_NEGATIVE_NUMBER = re.compile(r"-\d+$|-\d*\.\d+$")
_FLAG_NAME = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class ExtraArg:
    """One element of extraArgs as vLLM reads it."""

    index: int
    text: str
    flag: Optional[str] = None  # the name as vLLM normalises it (`--max-num-seqs`); None for a value
    value: Optional[str] = None  # the value given with `=` (or attached to a one-letter short option)
    value_index: Optional[int] = None  # the element after it, when that is its value


@dataclass
class ReadArgs:
    args: list[ExtraArg] = field(default_factory=list)
    problems: list[tuple[int, str, str]] = field(default_factory=list)  # (index, shown value, what is expected)

    def value_of(self, flag: str, extra_args: list[str]) -> Optional[str]:
        """The last value given for `flag` (its long form), as vLLM would take it, or None."""
        found = None
        for arg in self.args:
            if arg.flag is None or resolve(arg.flag) != flag:
                continue
            if arg.value is not None:
                found = arg.value
            elif arg.value_index is not None:
                found = extra_args[arg.value_index]
        return found

    def has(self, flag: str) -> bool:
        return any(arg.flag is not None and resolve(arg.flag) == flag for arg in self.args)

    def switch(self, name: str) -> Optional[bool]:
        """What READ_SWITCHES[name] is set to, as argparse leaves it: the last of its spellings given (a unique
        prefix of one counts as it), or None where none is."""
        spellings = READ_SWITCHES[name]
        found = None
        for arg in self.args:
            if arg.flag is None:
                continue
            matches = [flag for flag in spellings if flag == arg.flag] or [
                flag
                for flag in spellings
                if arg.flag.startswith("--") and len(arg.flag) > 2 and flag.startswith(arg.flag)
            ]
            if len(matches) == 1:
                found = spellings[matches[0]]
        return found


def normalise(arg: str) -> tuple[str, Optional[str]]:
    """(the flag name as FlexibleArgumentParser hands it to argparse, the `=` value or None)."""
    if arg.startswith("-O") and not arg.startswith("--") and arg != "-O":
        return "--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]
    if arg == "-O":
        return "--optimization-level", None
    name, sep, value = arg.partition("=")
    if name.startswith("--"):
        head, dot, rest = name[2:].partition(".")
        name = "--" + head.replace("_", "-") + dot + rest
    return name, (value if sep else None)


def resolve(name: str) -> str:
    """The protected flag `name` stands for as argparse reads a prefix, or `name` itself."""
    matches = candidates(name)
    return matches[0] if len(matches) == 1 else name


def candidates(name: str) -> list[str]:
    """The protected flags argparse could read `name` as: itself, or every one it is a prefix of
    (argparse refuses an ambiguous prefix at start, which is a late failure too)."""
    name = json_flag(name)
    if name in _PROTECTED or name in REFUSED_FLAGS:
        return [name]
    if name.startswith("--"):
        if len(name) <= 2:
            return []
        return sorted(flag for flag in {*_PROTECTED, *REFUSED_FLAGS} if flag.startswith(name))
    # One dash: a prefix of a short option (`-t` is `-tp`), or a one-letter option with its value
    # attached (`-n4` is `-n 4`).
    found = {flag for flag in _PROTECTED if not flag.startswith("--") and flag.startswith(name)}
    found |= {flag for flag in _PROTECTED if len(flag) == 2 and not flag.startswith("--") and name.startswith(flag)}
    return sorted(found)


def json_flag(name: str) -> str:
    """The flag a dotted name sets a key of (`--speculative-config.method` is `--speculative-config`):
    FlexibleArgumentParser.parse_args gathers every `FLAG.key[.key…][+]` into one JSON value of FLAG."""
    return name.split(".", 1)[0] if "." in name else name


def _is_option(arg: str) -> bool:
    """Whether argparse reads `arg` as an option rather than a value (vLLM has no negative-number options)."""
    return arg.startswith("-") and len(arg) > 1 and not _NEGATIVE_NUMBER.match(arg)


def _shown(arg: str, secret: bool) -> str:
    if secret and "=" in arg:
        return arg.split("=", 1)[0] + "=[secret]"
    return arg


def read_extra_args(extra_args: list[str]) -> ReadArgs:
    """Each element of `extra_args` as vLLM reads it, and every problem: (index, value shown, expected).

    An element after a flag given without `=` is read as that flag's value when argparse would take it
    as one (it does not look like an option, or it holds a space: `--chat-template-kwargs`'s JSON)."""
    read = ReadArgs()
    waiting: Optional[ExtraArg] = None  # a flag given without `=`: the next element may be its value
    for index, arg in enumerate(extra_args):
        if waiting is not None and any(match in SECRET_FLAGS for match in candidates(waiting.flag or "")):
            # whatever follows a secret flag is taken for its value: never shown, even when it looks like a flag
            read.args[-1] = ExtraArg(waiting.index, waiting.text, waiting.flag, None, index)
            read.args.append(ExtraArg(index, arg))
            waiting = None
            continue
        if waiting is not None and (not _is_option(arg) or " " in arg):
            read.args[-1] = ExtraArg(waiting.index, waiting.text, waiting.flag, None, index)
            read.args.append(ExtraArg(index, arg))
            waiting = None
            continue
        waiting = None
        if not _is_option(arg):
            read.args.append(ExtraArg(index, arg))
            read.problems.append((index, arg, "a flag (`--name`) before it: vLLM would read a lone value as the model"))
            continue
        if arg == "--":
            read.problems.append((index, arg, "no bare '--': vLLM would read every argument after it as the model"))
            continue
        name, value = normalise(arg)
        if not _FLAG_NAME.fullmatch(name):
            read.problems.append((index, *_malformed(arg)))
            continue
        entry = ExtraArg(index, arg, name, value)
        read.args.append(entry)
        matches = candidates(name)
        if matches:
            secret = any(match in SECRET_FLAGS for match in matches)
            read.problems.append((index, _shown(arg, secret), _protected_problem(name, matches)))
        if value is None:
            waiting = entry
    return read


def scrub_args(extra_args: list) -> list:
    """extraArgs as a message may show them: the value of a secret flag (under any spelling vLLM reads)
    replaced, whether it follows the flag or is joined to it with `=` or a space."""
    if not all(isinstance(arg, str) for arg in extra_args):
        return list(extra_args)
    read = read_extra_args(extra_args)
    shown = list(extra_args)
    for arg in read.args:
        if arg.flag is None or not any(match in SECRET_FLAGS for match in candidates(arg.flag)):
            continue
        if arg.value_index is not None:
            shown[arg.value_index] = "[secret]"
        shown[arg.index] = _shown(arg.text, True)
    for index, text in enumerate(shown):
        words = text.split(None, 1)
        if len(words) == 2 and any(m in SECRET_FLAGS for m in candidates(normalise(words[0])[0])):
            shown[index] = f"{words[0]} [secret]"
    return shown


def _malformed(arg: str) -> tuple[str, str]:
    """(value shown, expected) for an element that starts like a flag but is none."""
    words = arg.split(None, 1)
    if len(words) == 2 and _FLAG_NAME.fullmatch(normalise(words[0])[0]):
        flag, rest = words
        matches = candidates(normalise(flag)[0])
        if matches:  # the flag itself is the program's (or a secret): that is what to fix
            secret = any(match in SECRET_FLAGS for match in matches)
            return (f"{flag} [secret]" if secret else arg), _protected_problem(normalise(flag)[0], matches)
        example = f"[{flag!r}, {rest!r}] or '{flag}={rest}'"
        return arg, (
            f"a flag and its value as two elements: {example} (vLLM reads a flag with a space in it as one unknown "
            "word and refuses to start)"
        )
    return arg, "a flag such as --max-num-seqs (letters, digits, '-', '_', '.')"


def _protected_problem(name: str, matches: list[str]) -> str:
    if len(matches) == 1:
        flag = matches[0]
        read_as = (
            ""
            if flag == name
            else f"{name!r} is {flag} to vLLM (argparse reads a prefix as the flag it begins; '_' is '-'): "
        )
        if flag in SECRET_FLAGS:
            key = SECRET_FLAGS[flag]
            return (
                f"{read_as}no secret in extraArgs, where it sits in plain text in the stack file and on the node's "
                f"command line: set it with `pulumi config set --secret {key} …`"
            )
        if flag in REFUSED_FLAGS:
            return f"{read_as}not {flag}: {REFUSED_FLAGS[flag]}"
        return f"{read_as}a flag the program does not set itself: use its own key ({MANAGED_FLAGS[flag]})"
    listed = ", ".join(matches)
    return (
        f"a flag spelled out: vLLM reads a prefix as the flag it begins ({listed}), which the program sets itself "
        "or refuses; spell the flag you mean in full"
    )
