"""Jobs record the limits that applied (request or server ceiling); reads list jobs newest first by index.

The version row goes to 2 so an sltune 0.1 process refuses this database instead of writing to it.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sltune_jobs") as batch:
        batch.add_column(sa.Column("limits", sa.JSON, nullable=True))
    op.create_index("ix_sltune_jobs_created_at", "sltune_jobs", ["created_at"])
    op.execute("UPDATE sltune_schema_version SET version = 2")
