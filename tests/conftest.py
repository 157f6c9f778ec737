"""Fixtures every layer may ask for (real servers and workers, a throwaway PostgreSQL database), and the hook that marks
each test by its folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.postgres import fresh_pg_database
from tests.support.servers import Services


def pytest_configure(config):
    """Each xdist worker computes with its share of the cores: two workers of two torch threads each on two cores
    made the in-process tests three times slower than one thread each (OpenMP's threads waiting on each other).
    The trials, forked from a fork server started fresh, keep the machine's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def services(tmp_path):
    svc = Services(tmp_path, f"sqlite:///{tmp_path / 'jobs.db'}")
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def pg_server_url():
    url = os.environ.get("SLTUNE_TEST_PG_URL")
    if not url:
        pytest.skip("SLTUNE_TEST_PG_URL is not set (CI sets it; e.g. postgresql://postgres@127.0.0.1:5432/test)")
    return url


@pytest.fixture
def pg_url(pg_server_url):
    """A fresh database on the PostgreSQL server for one test, dropped afterwards."""
    yield from fresh_pg_database(pg_server_url)


@pytest.fixture(scope="module")
def pg_module_url(pg_server_url):
    """A fresh database for one test module (a server shared by its tests), dropped afterwards."""
    yield from fresh_pg_database(pg_server_url)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Mark each test by its folder (tests/integration/, tests/e2e/), before `-m` selects on the markers."""
    here = Path(__file__).resolve().parent
    for item in items:
        parts = Path(item.path).resolve().relative_to(here).parts
        if parts and parts[0] in ("integration", "e2e"):
            item.add_marker(getattr(pytest.mark, parts[0]))
