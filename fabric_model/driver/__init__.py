"""The driver: membership, progress, supervision and the event loop that routes between them (docs/architecture.md)."""
