"""What a build leaves running on the machine, apart from the pipeline's flows: the user's shared local Prefect server
(server.py, started by prefect_api.py on a socket it is handed), the warm build process (daemon.py), the template
databases (templates.py), locks and leases (locks.py), loopback helpers (net.py), and the private folders and secret
they rely on (private.py): all of it reachable by its own user only. Standard library only at import."""
