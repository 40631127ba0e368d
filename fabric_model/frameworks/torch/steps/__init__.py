"""The torch step strategies: one class per step mode, chosen per generation.

See choice.py, and docs/architecture.md, "Adding a step mode".
"""
