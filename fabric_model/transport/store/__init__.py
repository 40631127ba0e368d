"""The rendezvous store: served by the driver to the current generation only, over small
explicit frames, and read by the workers' process groups."""
