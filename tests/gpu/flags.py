"""Every option string of `vllm serve`, read from the installed vLLM's own parser: what
components/config/vllm_args.py resolves extraArgs against, and what its property test's argparse oracle uses.

    python3 -m tests.gpu.flags OUT.json      (on the GPU machine, where vLLM is installed: tests/gpu/device.sh)

Writes {"vllm": version, "python": version, "options": {option string: {"dest", "takes_value", "choices"}}}.
"""

from __future__ import annotations

import argparse
import json
import sys


def serve_options() -> dict:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve = ServeSubcommand().subparser_init(parser.add_subparsers())
    options = {}
    for option, action in sorted(serve._option_string_actions.items()):
        options[option] = {
            "dest": action.dest,
            "takes_value": action.nargs != 0,
            "choices": sorted(map(str, action.choices)) if action.choices else None,
        }
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    args = parser.parse_args(argv)
    import vllm

    report = {"vllm": vllm.__version__, "python": sys.version.split()[0], "options": serve_options()}
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1, sort_keys=True)
    print(f"flags: {len(report['options'])} option strings of vllm {report['vllm']} serve written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
