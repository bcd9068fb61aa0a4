"""Tests of gateway/admission (fixtures from tests/gateway/conftest.py, which pytest applies here too)."""
