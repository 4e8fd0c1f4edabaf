"""Shared fixtures: `pools(P)` gives a DistPool of P gloo processes, started once per test module."""
from __future__ import annotations

import pytest

from .dist_pool import DistPool


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(p):
        if p not in made:
            made[p] = DistPool(p)
        return made[p]

    yield get
    for pool in made.values():
        pool.close()
