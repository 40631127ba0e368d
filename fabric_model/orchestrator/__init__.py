"""The orchestrator: one ``train()`` call from start to end, above the driver, the frameworks and the
launchers it puts together (:func:`.pipeline.run_job`), with what it decides from them (the run
sized, the job serialized). docs/architecture.md, "Layers"."""
