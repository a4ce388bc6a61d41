"""State: one table of cache kinds (``cache_kinds``: every operation on a cache layer) and how a layer's state is
captured, restored, cut, batched and copied on the device (``cache_state``, ``row_caches``, ``batch_caches``,
``device_copy``). Stands on ``naming``.
"""
