"""Tiers: where checkpoints live. ``SpecCache`` (``cache``) over the memory tier, the LMDB store and the
shared tier; cache controls, the write-behind writer, the exit drain, shared prefetch and continuation records.
Stands on ``rows`` and ``drafters``; knows nothing of how a decode loop runs.
"""
