"""Alembic: an empty database and one made by sltune 0.1 (with an Optuna study beside it) both reach the
newest schema, which matches the ORM classes exactly; Optuna's tables live apart from sltune's."""

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import optuna
import pytest

from sltune.store import Store, engine_for, normalize_url
from sltune.store.schema import SCHEMA_VERSION, Base
from sltune.tuning.search.study import optuna_storage
from tests.support.fixtures import schema_v1


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("pg_url")


def _drift(url: str) -> list:
    with engine_for(url).connect() as conn:
        ours = {"include_name": lambda name, kind, _: kind != "table" or name in Base.metadata.tables}
        return compare_metadata(MigrationContext.configure(conn, opts=ours), Base.metadata)


def test_upgrade_head_on_an_empty_database(url):
    store = Store(url)
    assert _drift(url) == []
    job = store.create_job("j", {"search": {"max_trials": 1}}, "h", {})
    assert store.job(job.id).limits is None
    with engine_for(url).connect() as conn:
        assert conn.execute(sa.text("SELECT version FROM sltune_schema_version")).scalar() == SCHEMA_VERSION


def test_upgrade_head_on_a_database_made_by_sltune_0_1(url):
    old = sa.create_engine(normalize_url(url))
    schema_v1.Base.metadata.create_all(old)
    with old.begin() as conn:
        conn.execute(sa.insert(schema_v1.SchemaVersion).values(version=1))
        conn.execute(sa.insert(schema_v1.Job).values(
            id="old1", name="kept", spec={"search": {"max_trials": 2}}, spec_hash="x", status="succeeded",
            progress={}, requirements={}, cancel_requested=False, attempts=1, created_at=schema_v1.now()))
    old.dispose()
    optuna.create_study(study_name="sltune-old1", storage=url if "sqlite" in url else normalize_url(url))

    store = Store(url)
    assert store.job("old1").name == "kept" and store.job("old1").limits is None
    assert _drift(url) == []
    with engine_for(url).connect() as conn:       # sltune 0.1 checks this row and refuses a newer schema
        assert conn.execute(sa.text("SELECT version FROM sltune_schema_version")).scalar() == SCHEMA_VERSION
    if "postgresql" in url:                        # the old study moved along with Optuna's tables
        assert optuna.load_study(study_name="sltune-old1", storage=optuna_storage(url))
        assert _tables(url) == set(Base.metadata.tables) | {"sltune_alembic_version"}


def test_optuna_tables_live_apart_from_sltune_tables(url):
    Store(url)
    optuna.create_study(study_name="s", storage=optuna_storage(url))
    assert _tables(url) == set(Base.metadata.tables) | {"sltune_alembic_version"}
    assert optuna.load_study(study_name="s", storage=optuna_storage(url)).study_name == "s"


def _tables(url: str) -> set[str]:
    with engine_for(url).connect() as conn:
        return set(sa.inspect(conn).get_table_names())

