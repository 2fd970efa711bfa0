"""The per-step journal service."""
