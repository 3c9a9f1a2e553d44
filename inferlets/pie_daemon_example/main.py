"""A daemon inferlet in Python, as Pie's Rust ``http-server`` example is one in Rust: it exports
``wasi:http/incoming-handler`` instead of ``main(input)``. Launched with pie-client's
``launch_daemon(program, port)``, it serves HTTP on 127.0.0.1:port; each request gets a
fresh instance.

Endpoints:
- ``GET /``: a greeting to the launcher's user and the models this server has;
- ``POST /echo``: the request's body back, with its content type;
- ``GET /echo-headers``: the request's headers as JSON;
- ``POST /generate``: ``{"prompt": ..., "max_tokens": n}``: the model's greedy answer, streamed
  as it is generated (Pie's SDK on ``pie_loop``);
- ``GET /wait?ms=N``: sleeps N ms (default 1000) and says how long it slept, as Pie's own
  http-server example's ``/wait`` does (a daemon's requests run under the run limits: one
  past its wall-clock deadline is answered 500 with why);
- ``GET /fail``: a handler that raises before answering (the host answers 500 with why);
- anything else: 404.

Built by ``pie-media inferlet build`` (a ``main.py`` defining ``IncomingHandler`` is a daemon).
"""

import json
import time

import pie_loop
from componentize_py_types import Err, Ok
from inferlet import Context, Model, Sampler, chat, runtime
from wit_world import exports
from wit_world.imports import wasi_http_types as http
from wit_world.imports.streams import StreamError_Closed

CHUNK = 4096  # blocking-write-and-flush takes at most 4096 bytes a call


def read_body(request: http.IncomingRequest) -> bytes:
    body = request.consume()
    stream = body.stream()
    parts = []
    while True:
        try:
            parts.append(stream.blocking_read(65536))
        except Err as e:
            if isinstance(e.value, StreamError_Closed):
                break
            raise
    stream.__exit__(None, None, None)
    http.IncomingBody.finish(body).__exit__(None, None, None)
    return b"".join(parts)


class Reply:
    """A response whose head is sent at once and whose body is written as it comes."""

    def __init__(self, response_out: http.ResponseOutparam, status: int, content_type: str):
        response = http.OutgoingResponse(http.Fields.from_list([("content-type", content_type.encode())]))
        response.set_status_code(status)
        self.body = response.body()
        http.ResponseOutparam.set(response_out, Ok(response))
        self.stream = self.body.write()

    def write(self, data: bytes) -> None:
        for i in range(0, len(data), CHUNK):
            self.stream.blocking_write_and_flush(data[i : i + CHUNK])

    def finish(self) -> None:
        self.stream.__exit__(None, None, None)
        http.OutgoingBody.finish(self.body, None)


def respond(response_out: http.ResponseOutparam, status: int, content_type: str, data: bytes) -> None:
    reply = Reply(response_out, status, content_type)
    reply.write(data)
    reply.finish()


async def generate(prompt: str, max_tokens: int, reply: Reply) -> None:
    model = Model.load(runtime.models()[0])
    ctx = Context(model)
    ctx.user(prompt)
    decoder = chat.Decoder(model)
    async for step in ctx.generate(Sampler.argmax(), max_tokens=max_tokens):
        out = await step.execute()
        event = decoder.feed(out.tokens)
        if isinstance(event, chat.Event.Delta):
            reply.write(event.text.encode())
        elif isinstance(event, chat.Event.Done):
            break


class IncomingHandler(exports.IncomingHandler):
    def handle(self, request: http.IncomingRequest, response_out: http.ResponseOutparam) -> None:
        path = request.path_with_query() or "/"
        method = request.method()
        if path == "/" and isinstance(method, http.Method_Get):
            text = (
                f"Hello from a Pie daemon inferlet on pie-media, {runtime.username() or 'anonymous'}. "
                f"Models: {', '.join(runtime.models())}\n"
            )
            respond(response_out, 200, "text/plain; charset=utf-8", text.encode())
        elif path == "/echo" and isinstance(method, http.Method_Post):
            headers = dict(request.headers().entries())
            data = read_body(request)
            kind = headers.get("content-type", b"application/octet-stream").decode()
            respond(response_out, 200, kind, data)
        elif path == "/echo-headers":
            entries = [[k, v.decode("latin-1")] for k, v in request.headers().entries()]
            respond(response_out, 200, "application/json", json.dumps(entries).encode())
        elif path == "/generate" and isinstance(method, http.Method_Post):
            try:
                args = json.loads(read_body(request) or b"{}")
                prompt, max_tokens = str(args["prompt"]), int(args.get("max_tokens", 32))
            except (ValueError, KeyError, TypeError) as e:
                respond(response_out, 400, "text/plain", f"bad request: {e!r}\n".encode())
                return
            reply = Reply(response_out, 200, "text/plain; charset=utf-8")
            pie_loop.run(generate(prompt, max_tokens, reply))
            reply.finish()
        elif path == "/wait" or path.startswith("/wait?"):
            query = dict(p.split("=", 1) for p in path.partition("?")[2].split("&") if "=" in p)
            ms = int(query.get("ms", "1000"))
            start = time.monotonic()
            time.sleep(ms / 1000)
            slept = round((time.monotonic() - start) * 1000)
            respond(response_out, 200, "text/plain", f"Slept for {slept} ms\n".encode())
        elif path == "/fail":
            raise RuntimeError("this handler fails on purpose")
        else:
            respond(response_out, 404, "text/plain", f"no route for {path}\n".encode())
