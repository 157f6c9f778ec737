"""Fixtures every layer may ask for (real servers and workers, a throwaway PostgreSQL database), and the hook that marks
each test by its folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.postgres import fresh_pg_database
from tests.support.servers import Services


def pytest_configure(config):
    """Every process of the suite computes on one torch thread unless OMP_NUM_THREADS says otherwise: the test
    processes, and the trials, servers, workers and ranks they start, which inherit the variable. The suite runs
    several of them at once on 2 cores beside other work, where OpenMP's threads spin at their barriers waiting for a
    thread that has no core: 30 steps of llama-tiny beside the suite and a busy loop took 10.8 s and 6.0 CPU-seconds
    on two threads, 2.0 s and 0.8 on one. A trial that names hardware.cpu_threads still takes them."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")      # set before torch is first imported here, so it holds here too


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
