"""Benchmarks for the fencing package, kept outside the test suite: run ``python -m bench``.

Every benchmark is timed next to its baseline in the same run and the table reports their ratio, so the
numbers stay comparable across machines even when the absolute rates do not.
"""
