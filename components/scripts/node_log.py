"""Where the node modules' messages go: each program says once how it speaks (the supervisor into its log with
the time, the copy steps as `[node] …`), and every module it imports says through it. Standard library only."""

import sys

_VOICE = []


def speak_with(function):
    """`function(message)` says what the modules of this program say from now on."""
    _VOICE[:] = [function]


def say(message):
    if _VOICE:
        _VOICE[0](message)
    else:  # a module used on its own (a test): standard output, as every program's voice ends up
        print(message, flush=True, file=sys.stdout)
