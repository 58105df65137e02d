"""The ``opus`` command: ``main`` parses and dispatches; one module per command group."""
