"""What ``train()`` decides in the caller before any worker starts: every argument checked,
the run sized and placed on devices, the job serialized (docs/architecture.md, "Modules")."""
