"""The command-line face: ``i3core`` and the tools behind its commands.

Holds ``main`` (the parser and every command), ``log`` (logging set-up), ``scaffold`` (``i3core new``),
``launch`` (``i3core launch``: cluster files), ``evaluate`` (``i3core env eval``) and ``hookdoc`` (the generated
hook reference); ``python -m i3core.cli`` is ``i3core``.

May import: anything in :mod:`i3core` (the contract, :mod:`i3core.loop`, :mod:`i3core.sandbox`). Never a
plugin: components are found through the plugin manager.
"""
