"""A run that talks with its launcher: what Pie's protocol carries (stdout, stderr,
messages both ways, a result), driven by tests/api/http/test_pie_protocol.py."""

import sys

from pie_sdk import receive, send


def echo(*words):
    """Prints the words to stdout and stderr, sends each one, then answers every message it
    receives with ``echo: <message>`` until the launcher closes its side or sends ``bye``."""
    print("out:", *words, flush=True)
    print("err:", *words, file=sys.stderr, flush=True)
    for w in words:
        send(w)
    n = 0
    while True:
        m = receive()
        if m is None or m == "bye":
            break
        send("echo: " + m)
        n += 1
    return f"{len(words)} words, {n} messages"
