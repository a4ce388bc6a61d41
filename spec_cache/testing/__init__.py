"""Test fixtures that ship with the package: tiny models with random weights and their writers.

The default demo, the benchmarks and the tests build models here (no model hub). They use the library, never the
applications (``tools/check_layers.py``)."""
