"""Six trivial tests whose collection order tests/test_long_first.py reorders through MCP_LONG_TESTS."""
import pytest


@pytest.mark.parametrize("i", range(6))
def test_sample(i):
    assert i >= 0
