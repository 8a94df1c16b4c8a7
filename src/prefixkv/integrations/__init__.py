"""Integrations with other tools; each module imports its tool, an optional dependency, only when imported."""
