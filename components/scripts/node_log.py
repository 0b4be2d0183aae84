"""Where the node modules' messages go: each program says once how it speaks (the supervisor into its log with
the time, the copy steps as `[node] …`), and every module it imports says through it. Standard library only."""

_voice = None  # standard output until the program names its voice (a module used on its own: a test)


def speak_with(function):
    """`function(message)` says what the modules of this program say from now on."""
    global _voice
    _voice = function


def say(message):
    if _voice is None:
        print(message, flush=True)
    else:
        _voice(message)
