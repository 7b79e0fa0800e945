"""The sandbox runtime: what sandbox backends are built from, and the pool that leases them to rollouts.

Holds ``base`` (limits config, path-safe file access beneath a directory, the shared ``SandboxBase``),
``nsexec`` (namespaced exec through a fork server) and ``nsfork`` (that server: standard library only, run as
``python -I nsfork.py``), ``agent`` (the HTTP sidecar ``i3core sandbox-agent``) and ``pool`` (warm sandboxes,
leases, reset and health, used by the orchestrator).

May import: the contract at the top of :mod:`i3core` only. Sandbox plugins import this room; the loop imports
``pool``.
"""
