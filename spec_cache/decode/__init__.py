"""Decode: the speculative engine (admit, round, retire), the draft-depth controller, ``Generator`` and
warm-up. Stands on ``tiers``: it restores prefixes, drives rows and hands checkpoints back.
"""
