"""Where the rendezvous' secrets come from, and what one may look like.

A secret (the embedded service's token, an etcd password) is read from a file only its owner
can read, or from the environment; one given on the command line still works, but every local
user can read it in ``/proc/PID/cmdline``, so the launcher says so. A token is printable ASCII
without spaces: it travels in gRPC metadata, and anything else made every request fail with an
unhelpful "UNKNOWN TypeError".
"""

from __future__ import annotations

import os
import stat

from elastic_launch.rendezvous.api import RendezvousConfigError

TOKEN_ENV = "ELASTICRUN_RDZV_TOKEN"
PASSWORD_ENV = "ELASTICRUN_ETCD_PASSWORD"
MAX_SECRET = 4096
#: --rdzv-conf keys that hold a secret on the command line, and the key or variable to use.
ON_COMMAND_LINE = {
    "token": f"token_file=PATH or ${TOKEN_ENV}",
    "password": f"password_file=PATH or ${PASSWORD_ENV}",
}


def read_secret_file(path: str, key: str) -> str:
    """The secret in `path`: a regular file of this user that no one else can read (0600 or
    stricter), its text without the final newline."""
    where = f"--rdzv-conf {key}={path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RendezvousConfigError(f"{where}: cannot read it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RendezvousConfigError(f"{where}: not a regular file")
        if st.st_uid != os.getuid():
            raise RendezvousConfigError(
                f"{where}: owned by uid {st.st_uid}, not by this user ({os.getuid()}): a secret "
                "must be yours"
            )
        if st.st_mode & 0o077:
            raise RendezvousConfigError(
                f"{where}: mode {stat.S_IMODE(st.st_mode):04o} lets others read it; run "
                f"chmod 600 {path}"
            )
        raw = os.read(fd, MAX_SECRET + 2)
    finally:
        os.close(fd)
    try:
        text = raw.decode().removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise RendezvousConfigError(f"{where}: the file is not text (UTF-8)") from None
    if len(text) > MAX_SECRET:
        raise RendezvousConfigError(f"{where}: more than {MAX_SECRET} characters")
    return text


def check_token(token: str, where: str) -> str:
    """`token`, if it can travel as gRPC metadata: 1 to 4096 printable ASCII characters."""
    if not token or len(token) > MAX_SECRET:
        raise RendezvousConfigError(f"{where}: a token has 1 to {MAX_SECRET} characters")
    bad = next((c for c in token if not ("!" <= c <= "~")), None)
    if bad is not None:
        raise RendezvousConfigError(
            f"{where}: the token holds {bad!r}; use printable ASCII without spaces (for "
            "example: openssl rand -hex 16)"
        )
    return token


def command_line_secrets(raw: dict[str, str]) -> list[str]:
    """One warning per secret given in `raw` (``--rdzv-conf`` as typed on a command line)."""
    return [
        f"--rdzv-conf {key}=... puts a secret on the command line, where every user of this "
        f"host can read it (/proc/PID/cmdline); use {instead} instead"
        for key, instead in ON_COMMAND_LINE.items()
        if key in raw
    ]
