"""damacyd: the socket loop and its sessions (service, session), shared-memory slots (shm),
sockets and access (endpoint), cache warming (warm), metrics and logs, and the command (cli)."""
