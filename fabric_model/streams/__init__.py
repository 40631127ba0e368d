"""Sharded datasets read as streams, exactly once per epoch whatever the workers.

docs/architecture.md, "Sharded data"."""
