"""Machines' calibrated rates (`sltune calibrate`): a new table, which sltune 0.1 never reads, so the version row
stays.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sltune_machine_rates",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("machine", sa.String(64), nullable=False),
        sa.Column("workload", sa.String(64), nullable=False),
        sa.Column("rates", sa.JSON, nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_sltune_machine_rates_machine_workload", "sltune_machine_rates", ["machine", "workload"])
