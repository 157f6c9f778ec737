"""Baseline: the schema sltune 0.1 created (its `sltune_schema_version` row says 1).

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table("sltune_schema_version", sa.Column("version", sa.Integer, primary_key=True))
    op.execute("INSERT INTO sltune_schema_version (version) VALUES (1)")
    op.create_table(
        "sltune_jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("progress", sa.JSON, nullable=False),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("requirements", sa.JSON, nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
    )
    op.create_index("ix_sltune_jobs_spec_hash", "sltune_jobs", ["spec_hash"])
    op.create_index("ix_sltune_jobs_status", "sltune_jobs", ["status"])
    op.create_table(
        "sltune_trials",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("sltune_jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("optuna_number", sa.Integer, nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("tokens_per_s", sa.Float, nullable=True),
        sa.Column("peak_device_bytes", sa.BigInteger, nullable=True),
        sa.Column("peak_host_bytes", sa.BigInteger, nullable=True),
        sa.Column("predicted", sa.JSON, nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.UniqueConstraint("job_id", "number"),
    )
    op.create_index("ix_sltune_trials_job_id", "sltune_trials", ["job_id"])
    op.create_table(
        "sltune_fits",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("sltune_jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("n_trials", sa.Integer, nullable=False),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_sltune_fits_job_id", "sltune_fits", ["job_id"])
    op.create_table(
        "sltune_workers",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("capabilities", sa.JSON, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("last_seen", TS, nullable=False),
    )
    op.create_table(
        "sltune_artifacts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("sltune_jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("trial_number", sa.Integer, nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("path", sa.String(500), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_sltune_artifacts_job_id", "sltune_artifacts", ["job_id"])
