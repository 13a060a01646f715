"""Reproducible benchmarks: each script prints a table and writes JSON + PNG (bench/reporting.py).

Run from the repository root (README.md "Benchmarks" lists them); results go to a scratch
directory unless ``--publish`` replaces the committed ones in bench/results/.
"""
