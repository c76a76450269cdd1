"""The model wing: what is computed, on one device.

The drafter (drafter.py), its training objective of anchored blocks (objective.py), the frozen
target and its features (target.py), and the acceptance length tau (evaluate.py). Imports nothing
of the trainer but the top's config.
"""
