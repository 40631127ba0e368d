"""Keras 3 on TensorFlow: the driver half (:mod:`.framework`), the worker half (:mod:`.adapter`)
and what they use."""
