"""Tiny random models built in code, for the no-weights demo and the tests."""
