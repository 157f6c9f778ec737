"""PostgreSQL: Optuna's tables in a schema of their own (sltune.store.optuna); sltune 0.1 kept them
beside sltune's, so any already there move, studies and all. (On SQLite Optuna now uses a file of its
own; a 0.1 job resumed there starts a fresh study, its finished trials still read back from the store.)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

OPTUNA_TABLES = ("studies", "version_info", "study_directions", "study_user_attributes",
                 "study_system_attributes", "trials", "trial_user_attributes", "trial_system_attributes",
                 "trial_params", "trial_values", "trial_intermediate_values", "trial_heartbeats",
                 "alembic_version")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    op.execute("CREATE SCHEMA IF NOT EXISTS optuna")
    here = set(sa.inspect(bind).get_table_names(schema="public"))
    if "studies" in here:
        for table in OPTUNA_TABLES:
            if table in here:
                op.execute(f'ALTER TABLE public."{table}" SET SCHEMA optuna')
