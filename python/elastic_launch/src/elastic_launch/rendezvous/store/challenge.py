"""How a node proves it holds the job's token without ever sending it, and how it learns that
the service it talks to holds it too (a mutual HMAC challenge over etcd's Authenticate call).
Everything proven names who asks (an agent or a service), the endpoint it dialed and the
direction, so a process that passes a challenge on to another service gains nothing.

1. The client sends, as the password of user :data:`USER`, ``cn|dialed|asker``: a fresh nonce,
   the endpoint it dialed (as it wrote it) and who it is (:data:`AGENT` or :data:`SERVICE`).
2. A service that is not reached at ``dialed`` refuses (a process there passed the challenge
   on). Otherwise it answers ``sn:expires:role:proof``: its own nonce, when the session ends
   (its clock), whether it hosts or stands by, and ``HMAC(token, "service|dialed|asker|role|cn|
   sn|expires")``. Only a holder of the token can make that proof, for that endpoint and that
   fresh nonce, so a client stops there with anything else: it never sends a thing derived
   from its token to a service that has not proven it holds the token.
3. The client then sends, with every request, the credential ``cn|sn|expires|dialed|asker|mac``
   with ``mac = HMAC(token, "client|dialed|asker|cn|sn|expires")``, which the service checks
   without keeping any state (and refuses if ``dialed`` is not where it is reached). It ends at
   ``expires``; the client then logs in again (as after an etcd token's expiry).
4. An answer a service's peers act on (its status, the stream a standby follows) carries its
   own proof of a nonce the asker sent with the call (:func:`attest`): a process that took a
   port the asker once logged in to cannot make up the answer.

Without TLS, someone who reads the traffic can replay a credential to the service it names
until it expires (and reads the job's keys anyway); TLS (``cert``/``key``/``cacert``) closes
that. The token itself never crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

USER = "elasticrun-challenge-v2"
SESSION_SECONDS = 900
AGENT, SERVICE = "agent", "service"
HOST, STANDBY = "host", "standby"
#: The metadata key of the nonce an asker sends with a call, and of the answer's proof of it.
NONCE_KEY, PROOF_KEY = "elasticrun-nonce", "elasticrun-proof"
_NONCE = re.compile(r"[0-9a-f]{32}")
_DIALED = re.compile(r"[!-{}~]{1,300}")  # printable, no "|" and no space


def nonce() -> str:
    return os.urandom(16).hex()


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def valid_nonce(text: str) -> bool:
    return bool(_NONCE.fullmatch(text))


@dataclass(frozen=True)
class Ask:
    """A login's first step: a fresh nonce, the endpoint the asker dialed, and who asks."""

    nonce: str
    dialed: str
    asker: str

    @property
    def password(self) -> str:
        """What it sends as the login's password."""
        return "|".join((self.nonce, self.dialed, self.asker))


def ask(dialed: str, asker: str = AGENT) -> Ask:
    """A login to the service the asker reaches at `dialed` (``host:port``, as it wrote it)."""
    return Ask(nonce(), dialed, asker)


def parse_ask(password: str) -> Ask | None:
    """The login a client's password asks for, or None if it is not one."""
    parts = password.split("|")
    if len(parts) != 3 or not valid_nonce(parts[0]) or parts[2] not in (AGENT, SERVICE):
        return None
    if not _DIALED.fullmatch(parts[1]):
        return None
    return Ask(*parts)


def answer(token: str, asked: Ask, role: str, now: float) -> str:
    """The service's reply to `asked` (checked first: it was dialed at this service)."""
    server_nonce, expires = nonce(), str(int(now) + SESSION_SECONDS)
    proof = _mac(
        token, "service", asked.dialed, asked.asker, role, asked.nonce, server_nonce, expires
    )
    return ":".join((server_nonce, expires, role, proof))


def respond(token: str, asked: Ask, reply: str) -> str:
    """The client's credential, once `reply` proves that a holder of `token` answered `asked`
    at the endpoint it dialed; ValueError (saying why) otherwise."""
    parts = reply.split(":")
    if len(parts) != 4 or not valid_nonce(parts[0]) or not parts[1].isascii():
        raise ValueError("its answer is not a challenge reply")
    server_nonce, expires, role, proof = parts
    expected = _mac(
        token, "service", asked.dialed, asked.asker, role, asked.nonce, server_nonce, expires
    )
    if not hmac.compare_digest(proof, expected):
        raise ValueError(
            f"its proof does not match this node's token and {asked.dialed} (a process "
            "there without the token may be passing the login on to another service)"
        )
    mac = _mac(token, "client", asked.dialed, asked.asker, asked.nonce, server_nonce, expires)
    return "|".join((asked.nonce, server_nonce, expires, asked.dialed, asked.asker, mac))


def check(token: str, credential: str, now: float, reached_at: Callable[[str], bool]) -> str | None:
    """None if `credential` was made with `token` for an endpoint at which this service is
    reached (`reached_at`) and has not expired, else why not."""
    parts = credential.split("|")
    if len(parts) != 6 or not all(valid_nonce(p) for p in parts[:2]):
        return "no credential (log in with the job's token first)"
    client_nonce, server_nonce, expires, dialed, asker, mac = parts
    if not (expires.isascii() and expires.isdigit() and len(expires) < 16):
        return "a malformed credential"
    expected = _mac(token, "client", dialed, asker, client_nonce, server_nonce, expires)
    if not hmac.compare_digest(mac, expected):
        return "a credential made with another token"
    if int(expires) < now:
        return "an expired credential"
    if not reached_at(dialed):
        return f"a credential for {dialed}, which is not this service"
    return None


def dialed_of(credential: str) -> str:
    """The endpoint a credential was earned for ("" if it is not one)."""
    parts = credential.split("|")
    return parts[3] if len(parts) == 6 else ""


def asking(metadata: list[tuple[str, str]], proven: bool) -> tuple[str, list[tuple[str, str]]]:
    """A call's nonce and its `metadata` with it, where the answer is to be `proven` (the job
    has a token); ("", `metadata`) where nothing can be."""
    if not proven:
        return "", metadata
    call_nonce = nonce()
    return call_nonce, [*metadata, (NONCE_KEY, call_nonce)]


def attest(token: str, dialed: str, call_nonce: str, *said: str) -> str:
    """A service's proof that it, reached at `dialed`, answers the call that sent `call_nonce`
    with what `said` holds."""
    return _mac(token, "answer", dialed, call_nonce, *said)


def attested(token: str, dialed: str, call_nonce: str, proof: str, *said: str) -> bool:
    """Whether `proof` is :func:`attest`'s for this call and this answer."""
    return hmac.compare_digest(proof, attest(token, dialed, call_nonce, *said))


def status_said(status: Any) -> tuple[str, ...]:
    """What a status answer says that its proof covers (who hosts, which term and fork)."""
    return tuple(
        str(v)
        for v in (
            status.header.member_id,
            status.leader,
            status.raftTerm,
            status.raftIndex,
            status.isLearner,
            status.header.revision,
            status.header.cluster_id,
        )
    )
