"""The inflight.v1 protobuf contract and its generated Python stubs.

Regenerate with ``python -m protos.generate`` after editing a ``.proto`` file;
``tests/protos/test_stubs_fresh.py`` fails when the committed stubs are stale.
"""
