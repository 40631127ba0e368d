"""What a run leaves for people and tools: the run directory, the metrics log, the hooks that
dispatch to loggers, the display, TensorBoard records, plots and ``fabric-model status``."""
