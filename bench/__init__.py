"""Reproducible benchmarks (see docs/ and DESIGN.md "Measuring")."""
