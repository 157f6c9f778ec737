"""Alembic's entry point: runs on the connection sltune.store.db hands it (never a URL from an ini file)."""

from alembic import context

from sltune.store.migrations.names import VERSION_TABLE
from sltune.store.schema import Base

context.configure(connection=context.config.attributes["connection"], target_metadata=Base.metadata,
                  version_table=VERSION_TABLE, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
