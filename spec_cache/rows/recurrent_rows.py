"""Recurrent layers (mlx-lm ``ArraysCache``: conv state + recurrent state) in batched target rows.

A hybrid target (``qwen3_next``) mixes attention layers, whose K/V the rows hold as in ``TargetRows``, with
recurrent layers holding one fixed-size state per row. That state is never trimmable: a rejected draft cannot be
cut off it. Two ways back were weighed:

* keep the state after every position of the verify window: for Qwen3-Next-80B one layer's state is 32 heads x
  128 x 128 float32 = 2 MiB per row and position, x 36 recurrent layers x a 5-token window = 360 MiB per row per
  round;
* **replay** (chosen): keep the states from before the verify forward (no copy: MLX arrays are values) and each
  recurrent layer's mixer input for the window (``[B, L, H]``, a few KiB), and on rollback run only the
  recurrent mixers again over the kept prefix of the window, one batched call per layer with per-row lengths
  (``ArraysCache.lengths``, as mlx-lm's batched prefill masks right padding). Attention and MLPs are not re-run:
  a recurrent layer's input at a kept position does not depend on later positions. Rows that kept their whole
  window keep the verified state unchanged.

The per-row state operations (read, merge, join, clone, split an ``ArraysCache``) are the table's ``arrays`` kind's
(``spec_cache.state.cache_kinds``), over the mechanics in ``spec_cache.state.batch_caches``; this module re-exports
them for their old import path. ``spec_cache.rows.target.HybridTargetRows`` runs the replay beside the
``TargetRows`` it extends.

Checkpoints hold the state exactly at their boundary (an exact-boundary entry the store never trims); a restored
state serves only its own length (the ``arrays`` kind's ``cut`` answers None for anything shorter).
"""

from __future__ import annotations

from spec_cache.state.batch_caches import clone_states, join_states, merge_states, split_state

__all__ = ["merge_states", "join_states", "clone_states", "split_state"]
