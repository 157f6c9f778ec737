"""Names the migration runner (sltune.store.db) and Alembic's env.py share."""

VERSION_TABLE = "sltune_alembic_version"   # not Optuna's alembic_version, should both share a database
BASELINE = "0001"                          # the schema sltune 0.1 created without Alembic
