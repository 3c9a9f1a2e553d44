"""Sign-in of a Pie protocol connection (PROTOCOL.md §4).

* A server without keys answers ``auth_identify`` with the one string the client reads as
  "authentication is off"; the connection is then the anonymous admin, as an HTTP request
  without keys is.
* ``auth_by_token``: one of the server's API keys (``--api-key-file`` / PIE_MEDIA_API_KEYS);
  the connection then acts as that key's caller and tenant (``api/http/security/tenancy.py``).
* ``auth_identify`` + ``auth_prove``: the name of a key file entry that carries a
  ``public_key`` (``api/http/security/keys.py``); the server answers a random challenge (32
  bytes, base64), the client signs the raw bytes, the server verifies: Ed25519, ECDSA
  P-256/SHA-256 and P-384/SHA-384 (DER), RSA PKCS#1 v1.5/SHA-256. A challenge is good for
  one ``auth_prove``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import random
import secrets
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from api.http.security.keys import ApiKeys, PublicKey
from api.http.security.tenancy import ANONYMOUS, Caller

AUTH_OFF = "Authenticated (Engine disabled authentication)"
"""The exact reply that tells pie-client the server does not authenticate."""
CHALLENGE_BYTES = 32
BAD_TOKEN_DELAY_S = (0.2, 0.6)
"""A wrong token is answered after a random pause in this range (guessing costs time)."""


def verify(key: PublicKey, signature: bytes, challenge: bytes) -> bool:
    """Whether ``signature`` is ``key``'s over ``challenge``, by the scheme pie-client signs with."""
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, challenge)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            digest = hashes.SHA384() if key.curve.name == "secp384r1" else hashes.SHA256()
            key.verify(signature, challenge, ec.ECDSA(digest))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, challenge, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


class Auth:
    """One connection's sign-in state. Each method returns (ok, result text)."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys
        self.caller: Caller | None = None
        self.username: str = ""
        self._challenge: tuple[str, bytes, PublicKey, Caller] | None = None

    @property
    def authenticated(self) -> bool:
        return self.caller is not None

    def identify(self, username: Any) -> tuple[bool, str]:
        if self.authenticated:
            return True, "Already authenticated"
        if not isinstance(username, str) or not username:
            return False, "auth_identify needs a username (a string)"
        if not self.keys.enabled:
            self.caller, self.username = ANONYMOUS, username
            return True, AUTH_OFF
        found = self.keys.public_key(username)
        if found is None:
            return False, (
                f"User '{username}' is not authorized: no key entry of that name carries a public_key "
                "(or sign in with auth_by_token and an API key)"
            )
        key, caller = found
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        self._challenge = (username, challenge, key, caller)
        return True, base64.b64encode(challenge).decode()

    def prove(self, signature: Any) -> tuple[bool, str]:
        if self.authenticated:
            return False, "Already authenticated"
        pending, self._challenge = self._challenge, None  # one try per challenge
        if pending is None:
            return False, "no challenge to prove: send auth_identify first"
        username, challenge, key, caller = pending
        if not isinstance(signature, str):
            return False, "auth_prove needs a signature (base64 text)"
        try:
            raw = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError):
            return False, "the signature is not base64"
        if not verify(key, raw, challenge):
            return False, f"Signature verification failed for '{username}'"
        self.caller, self.username = caller, username
        return True, "Authenticated"

    async def by_token(self, token: Any) -> tuple[bool, str]:
        if self.authenticated:
            return True, "Already authenticated"
        if not self.keys.enabled:
            self.caller, self.username = ANONYMOUS, "anonymous"
            return True, "Authenticated"
        caller = self.keys.identify_token(token) if isinstance(token, str) and token else None
        if caller is None:
            await asyncio.sleep(random.uniform(*BAD_TOKEN_DELAY_S))
            return False, "Invalid token"
        self.caller, self.username = caller, caller.name
        return True, "Authenticated"
