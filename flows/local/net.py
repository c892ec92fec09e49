"""Loopback primitives shared by the Prefect server helpers (flows/local/server.py, flows/serve.py,
flows/local/templates.py): whether an API answers its health check, whether it is this user's and knows this user's
secret, and a port on 127.0.0.1 held from the moment it is chosen (no bind-close-rebind race). Standard library only."""
from __future__ import annotations

import base64
import os
import socket
import urllib.error
import urllib.request


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    """Whether the API answers /health (which Prefect serves without authentication)."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def auth_header(secret: str) -> dict[str, str]:
    """The header Prefect's client sends with PREFECT_API_AUTH_STRING."""
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}


def status(api_url: str, path: str, secret: str | None, timeout: float = 2.0) -> int:
    """The HTTP status of GET api_url/path, with the secret when given (0: no answer)."""
    req = urllib.request.Request(f"{api_url.rstrip('/')}{path}", headers=auth_header(secret) if secret else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def authenticated(api_url: str, secret: str, timeout: float = 2.0) -> bool:
    """Whether the Prefect API at api_url requires authentication and accepts `secret` (a server without
    authentication, or with another secret, is not the one trtforge started with it)."""
    return (status(api_url, "/admin/version", None, timeout) == 401
            and status(api_url, "/admin/version", secret, timeout) == 200)


# how /proc/net/tcp{,6} write the addresses whose listener answers 127.0.0.1: itself, 0.0.0.0, ::, ::ffff:127.0.0.1
LOOPBACK_LISTENERS = {"0100007F", "00000000", "0" * 32, "0000000000000000FFFF00000100007F"}


def listener_uid(port: int) -> int | None:
    """The uid owning the socket that listens for 127.0.0.1:port, from the kernel's socket table (None: nothing
    listens, or the table cannot be read). Asked before a secret is sent to whatever answers on a port."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    fields = line.split()
                    addr, hexport = fields[1].rsplit(":", 1)
                    if fields[3] == "0A" and int(hexport, 16) == port and addr in LOOPBACK_LISTENERS:  # 0A: LISTEN
                        return int(fields[7])
        except (OSError, ValueError, IndexError):
            continue
    return None


def reserve(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), not listening yet: the port is this process's from here on
    (no SO_REUSEADDR, so nobody else binds it) and is handed to the server that listens on it (pass_fds).
    OSError when the port is taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    os.set_inheritable(s.fileno(), True)
    return s


def free_port() -> int:
    """A port free right now (tests that start servers of their own); trtforge's servers use reserve()."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
