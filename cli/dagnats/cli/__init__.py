"""The ``dagnats`` command line."""

__all__: list[str] = []
