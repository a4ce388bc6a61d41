"""Training: ``train-drafter``'s data, loop, head and held-out evaluation. Stands on ``decode``: it generates
the target's own answers with ``Generator``, which the drafter providers in ``drafters`` must never import.
"""
