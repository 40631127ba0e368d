"""The training state kept, moved and saved: checkpoints (format, files, the best ones),
the driver's writer, rank 0's uploads, and the state a joining worker
pulls (docs/architecture.md, "Run directory", "Elasticity")."""
