"""Fixtures of the cluster tests: the namespace hosts (tests/hosts.py)."""

from __future__ import annotations

import pytest

from tests import hosts


@pytest.fixture
def make_hosts(tmp_path):
    """make_hosts(n, loopback=()) builds an n-host cluster, torn down after the test."""
    yield from hosts.make_hosts_fixture(tmp_path)
