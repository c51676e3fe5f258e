"""The internal plane's security: who a process is, and who may call what.

``certs``: a local certificate authority and one certificate per role (``tokenfleet certs``).
``identity``: this process's certificate, read from files and re-read when they change, with expiry
warnings. ``plane``: how a process talks to the others: mutual TLS with its role's certificate (the
default) or plaintext (``--insecure``, warned about at every start); channels verify the peer's role.
``authz``: which role may call which RPC (deny by default), enforced by a server interceptor, and
the audit log of administrative calls.

No service imports: the services, the launcher and the CLI use this package.
"""
