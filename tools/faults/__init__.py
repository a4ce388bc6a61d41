"""Fault-injection harnesses for the store: crash, corruption, concurrency, space, hostile input, isolation.

Each harness is a module with ``run(...) -> dict`` (figures for RELIABILITY.md) and a ``main(argv)`` that runs
it by hand with a trial count, e.g. ``python -m tools.faults.crash --trials 200``. ``python -m tools.faults``
runs all of them at their full size and prints the table. ``tests/store/test_faults.py`` runs each in a quick form.
"""
