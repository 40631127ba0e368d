"""Launchers: where worker processes run (local processes today; see docs/architecture.md)."""
