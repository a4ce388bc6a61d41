"""The applications people run: the CLI, the two servers, the benchmarks and the demos.

They sit above the library (``spec_cache``) and the test fixtures (``spec_cache.testing``); nothing below imports
them (``tools/check_layers.py``)."""
