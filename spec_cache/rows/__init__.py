"""Rows: the row protocol (``protocol``), the target model and its ports, batched, quantized and recurrent
rows, KV quantization, sampling, adapters and the shape of a generate call. Stands on ``state``.
"""
