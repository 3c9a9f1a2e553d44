"""One guest component holding the examples; the first argument picks one."""

import wit_world
from componentize_py_types import Err
from pie_sdk import Context, InferletError, args, send


def chat(model: str, prompt: str, n: str) -> str:
    ctx = Context(model).user(prompt).cue()
    return ctx.generate(max_tokens=int(n))


def best_of(model: str, prompt: str, n: str, k: str) -> str:
    base = Context(model).user(prompt).cue()
    outs = []
    for _ in range(int(k)):
        f = base.fork()
        outs.append(f.generate(max_tokens=int(n)))
        send(outs[-1])
    return max(outs, key=len)


def loop() -> str:
    while True:
        pass


def bomb() -> str:
    xs = []
    while True:
        xs.append(bytearray(1 << 20))


def handles(model: str) -> str:
    while True:
        Context(model)


def forged() -> str:
    return Context("x", _handle=12345).generate(4)


EXAMPLES = {
    "chat": chat,
    "best-of": best_of,
    "loop": loop,
    "bomb": bomb,
    "handles": handles,
    "forged": forged,
}


class WitWorld(wit_world.WitWorld):
    def run(self) -> str:
        a = args()
        try:
            return EXAMPLES[a[0]](*a[1:])
        except InferletError as e:
            raise Err(str(e)) from None
