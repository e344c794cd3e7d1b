"""How a node proves it holds the job's token without ever sending it, and how it learns that
the service it talks to holds it too (a mutual HMAC challenge over etcd's Authenticate call).

1. The client sends a fresh nonce ``cn`` as the password of user :data:`USER`.
2. The service answers ``sn:expires:proof``: its own nonce, when the session ends (its clock)
   and ``HMAC(token, "service|cn|sn|expires")``. Only a holder of the token can make the proof
   for the client's fresh nonce, so a client stops there with anything else: it never sends a
   thing derived from its token to a service that has not proven it holds the token.
3. The client then sends, with every request, the credential ``cn:sn:expires:HMAC(token,
   "client|cn|sn|expires")``, which the service checks without keeping any state. It ends at
   ``expires``; the client then logs in again (as after an etcd token's expiry).

Without TLS, someone who reads the traffic can replay a credential until it expires (and reads
the job's keys anyway); TLS (``cert``/``key``/``cacert``) closes that. The token itself never
crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

USER = "elasticrun-challenge-v1"
SESSION_SECONDS = 900
_NONCE = re.compile(r"[0-9a-f]{32}")


def nonce() -> str:
    return os.urandom(16).hex()


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def valid_nonce(text: str) -> bool:
    return bool(_NONCE.fullmatch(text))


def answer(token: str, client_nonce: str, now: float) -> str:
    """The service's reply to `client_nonce` (checked with :func:`valid_nonce` first)."""
    server_nonce, expires = nonce(), str(int(now) + SESSION_SECONDS)
    return ":".join(
        (server_nonce, expires, _mac(token, "service", client_nonce, server_nonce, expires))
    )


def respond(token: str, client_nonce: str, reply: str) -> str:
    """The client's credential, once `reply` proves the service holds `token`; ValueError
    (saying why) otherwise."""
    parts = reply.split(":")
    if len(parts) != 3 or not valid_nonce(parts[0]) or not parts[1].isascii():
        raise ValueError("its answer is not a challenge reply")
    server_nonce, expires, proof = parts
    expected = _mac(token, "service", client_nonce, server_nonce, expires)
    if not hmac.compare_digest(proof, expected):
        raise ValueError("its proof does not match this node's token")
    mac = _mac(token, "client", client_nonce, server_nonce, expires)
    return ":".join((client_nonce, server_nonce, expires, mac))


def check(token: str, credential: str, now: float) -> str | None:
    """None if `credential` was made with `token` and has not expired, else why not."""
    parts = credential.split(":")
    if len(parts) != 4 or not all(valid_nonce(p) for p in parts[:2]):
        return "no credential (log in with the job's token first)"
    client_nonce, server_nonce, expires, mac = parts
    if not (expires.isascii() and expires.isdigit() and len(expires) < 16):
        return "a malformed credential"
    expected = _mac(token, "client", client_nonce, server_nonce, expires)
    if not hmac.compare_digest(mac, expected):
        return "a credential made with another token"
    if int(expires) < now:
        return "an expired credential"
    return None
