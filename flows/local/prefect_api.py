"""`python -m flows.local.prefect_api PORT`: `prefect server start --host 127.0.0.1 --port PORT`, started sooner than the
`prefect` script starts it. Importing Prefect's server modules is most of a server's start (about 2.2 s of 2.8 s on a
2-core host) and Python's cyclic garbage collector, passing over the many objects those imports create, is a fifth of
that: here they are imported with the collector paused, which resumes (the modules' objects frozen out of its passes,
as they live as long as the server) before `prefect server start` runs in this process. Used by every local server
trtforge starts: the shared one (flows/local/server.py), `make serve`'s (flows/serve.py) and the template's (flows/local/templates.py)."""
from __future__ import annotations

import sys


def server_command(port: int) -> list[str]:
    """The command that runs the Prefect server on 127.0.0.1:port."""
    return [sys.executable, "-m", "flows.local.prefect_api", str(port)]


def main(port: int) -> int:
    import gc

    gc.disable()
    try:
        import prefect.server.api.server  # noqa: F401
        from prefect.cli import app
    finally:
        gc.enable()
    gc.freeze()
    sys.argv = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return app() or 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: python -m flows.local.prefect_api PORT", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(int(sys.argv[1])))
