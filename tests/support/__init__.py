"""Helpers shared by the tests, imported as ``tests.support.NAME``.

pytest puts the repository root on ``sys.path`` (``pythonpath`` in pyproject.toml), so these and the
``bench`` package import the same way from every test directory, each module loaded once.
"""
