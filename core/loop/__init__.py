"""The loop: the three roles and what they share.

Holds ``run`` (``i3core run``: every role on one machine), ``roles`` (each role on its own), ``orchestrator``,
``trainer``, and the pieces between them: ``paths`` (the run directory), ``packing`` (rollouts into rows),
``checkpoint`` (what a resumed run continues from), ``events`` (the event hooks' calls), ``perf`` (MFU and
activation memory), ``plot`` (a run's figures) and ``doorbell`` (a colocated trainer's wake-ups).

May import: the contract at the top of :mod:`i3core` and the sandbox runtime (:mod:`i3core.sandbox`, for the
pool). Never :mod:`i3core.cli` nor any plugin: components reach the loop as objects built from the registry.
"""
