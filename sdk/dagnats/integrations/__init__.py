"""Integrations of dagnats with agent frameworks.

Each one lives in its own subpackage and imports its framework only there, so
the SDK runs without any of them: ``dagnats.integrations.pydantic_ai`` needs
the ``pydantic-ai`` extra (``pip install 'dagnats[pydantic-ai]'``).
"""
