"""The worker process: connect, receive the job, train generation after generation, report (docs/architecture.md)."""
