"""What a build leaves running on the machine, apart from the pipeline's flows: the shared local Prefect server
(server.py, started by prefect_api.py), the warm build process (daemon.py), the template databases (templates.py),
locks and leases (locks.py), and loopback primitives (net.py).
Standard library only at import."""
