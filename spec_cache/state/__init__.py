"""State: one table of cache kinds (``cache_kinds``) and how a layer's state is captured, restored, cut and
copied on the device (``cache_state``, ``row_caches``, ``device_copy``). Stands on ``naming``.
"""
