"""Pie's client protocol (``pie-client==0.4.0``, WebSocket + msgpack) on pie-media's port.

framing.py   one msgpack map per binary frame; responses; sizes under the client's 1 MiB
auth.py      auth_identify (auth off: the magic reply; else a challenge) / auth_prove
             (Ed25519, ECDSA, RSA) / auth_by_token (an API key): the session's caller
programs.py  check_program, the chunked add_program, installs per tenant in the inferlet store
processes.py launch / attach / terminate / list / signal over the server's run table; events
mcp_relay.py register_mcp_server / mcp_request / mcp_response: the relay the WIT host's
             pie:mcp/client calls (mcp_call, submit, client_for; see its docstring)
session.py   one connection: dispatch by type, answers and events (files as chunks) through
             one writer; transfer_file to the run
daemons.py   launch_daemon: a component exporting wasi:http/incoming-handler served on
             127.0.0.1:port, a fresh instance per request
route.py     the WebSocket route at ``/``
"""

from api.http.pie_protocol.route import router

__all__ = ["router"]
