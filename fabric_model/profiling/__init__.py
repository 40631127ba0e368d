"""The step profiler: ``train(profile=...)`` (docs/training.md, "Profiling"; docs/architecture.md, "Profiling")."""
