"""What ``train()`` checks and decides in the caller before any worker starts: every argument
checked, the run's configuration, devices and threads (docs/architecture.md, "Modules").
Nothing here imports the frameworks, launchers or driver: the orchestrator calls them."""
