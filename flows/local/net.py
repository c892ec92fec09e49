"""Local network primitives shared by the Prefect server helpers (flows/local/server.py, flows/serve.py, flows/local/templates.py):
whether an API answers its health check, and a free port on 127.0.0.1. Standard library only."""
from __future__ import annotations

import socket
import urllib.request


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
