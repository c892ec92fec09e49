"""`python -m flows.local.prefect_api PORT [FD]`: Prefect's API server (what `prefect server start --host 127.0.0.1
--port PORT` runs), started sooner than the `prefect` script starts it, and on a socket it is handed.

Importing Prefect's server modules is most of a server's start (about 2.2 s of 2.8 s on a 2-core host) and Python's
cyclic garbage collector, passing over the many objects those imports create, is a fifth of that: here they are
imported with the collector paused, which resumes (the modules' objects frozen out of its passes, as they live as long
as the server) before the server runs. With FD (a TCP socket bound to 127.0.0.1:PORT by whoever started it,
flows/local/net.py reserve) uvicorn serves that socket, so the port is never free between its choice and the server's
start (`prefect server start` binds it again itself). Authentication: PREFECT_SERVER_API_AUTH_STRING in the
environment (flows/local/server.py sets it). Used by every local server trtforge starts: the shared one
(flows/local/server.py), `make serve`'s (flows/serve.py) and the template's (flows/local/templates.py)."""
from __future__ import annotations

import sys


def server_command(port: int, fd: int | None = None) -> list[str]:
    """The command that runs the Prefect server on 127.0.0.1:port (on the socket `fd` when given)."""
    return [sys.executable, "-m", "flows.local.prefect_api", str(port), *([str(fd)] if fd is not None else [])]


def main(port: int, fd: int | None = None) -> int:
    import gc

    gc.disable()
    try:
        import prefect.server.api.server  # noqa: F401
        from prefect.cli import app
    finally:
        gc.enable()
    gc.freeze()
    if fd is None:
        sys.argv = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        return app() or 0
    return _serve_socket(port, fd)


def _serve_socket(port: int, fd: int) -> int:
    """What `prefect server start` runs in the foreground (prefect/cli/_server_utils.py _run_in_foreground, one
    worker, settings from the environment), on the socket it is handed."""
    import socket

    import uvicorn

    import prefect.settings as ps
    from prefect.server.api.server import create_app
    from prefect.settings import temporary_settings

    sock = socket.socket(fileno=fd)
    if sock.getsockname()[1] != port:
        print(f"prefect_api: the socket handed over is not on port {port}", file=sys.stderr)
        return 2
    level = ps.PREFECT_SERVER_LOGGING_LEVEL.value()
    settings = {"PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": str(ps.PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED.value()),
                "PREFECT_SERVER_ANALYTICS_ENABLED": str(ps.PREFECT_SERVER_ANALYTICS_ENABLED.value()),
                "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": str(ps.PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED.value()),
                "PREFECT_SERVER_UI_ENABLED": str(ps.PREFECT_SERVER_UI_ENABLED.value()),
                "PREFECT_SERVER_LOGGING_LEVEL": level}
    print(f"prefect server on http://127.0.0.1:{port} (socket handed over)", flush=True)
    with temporary_settings({getattr(ps, k): v for k, v in settings.items()}):
        config = uvicorn.Config(app=create_app(final=True, webserver_only=False),
                                host="127.0.0.1", port=port,
                                timeout_keep_alive=ps.PREFECT_SERVER_API_KEEPALIVE_TIMEOUT.value(),
                                ws_ping_interval=ps.PREFECT_SERVER_API_WEBSOCKET_PING_INTERVAL.value(),
                                ws_ping_timeout=ps.PREFECT_SERVER_API_WEBSOCKET_PING_TIMEOUT.value(),
                                log_level=level.lower())
        uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or not all(a.isdigit() for a in sys.argv[1:]):
        print("usage: python -m flows.local.prefect_api PORT [FD]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else None))
