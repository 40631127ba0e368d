"""Keras on TensorFlow, Keras 3 (``keras``) and Keras 2 (``tf_keras``): the driver half (:mod:`.framework`),
the worker half (:mod:`.adapter`), where the two Keras differ (:mod:`.flavor`, :mod:`.keras2`) and what they use."""
