"""The tables: jobs, their trials, fitted models and artifacts (files on disk, referenced here).

Alembic migrations (sltune/store/migrations/) change the database; these classes must match their
result. The `sltune_schema_version` row is kept, and raised by migrations that older sltune releases
cannot use, because those releases check it and refuse rather than write to a newer schema.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text,
                        TypeDecorator, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

SCHEMA_VERSION = 2     # the row migrations write; raised only by those sltune 0.1 cannot work with


def now() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timestamps in UTC on every database: SQLite hands back naive datetimes, which would otherwise be
    read as local time."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class SchemaVersion(Base):
    __tablename__ = "sltune_schema_version"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)


class Job(Base):
    __tablename__ = "sltune_jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    spec_hash: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    progress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # what a worker must offer to run it: device kind, device memory, world size
    requirements: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # per resource limit: what the request asked for, what applies, and whose it is (request or server)
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    trials: Mapped[list["Trial"]] = relationship(back_populates="job", order_by="Trial.number",
                                                 cascade="all, delete-orphan")


class Trial(Base):
    __tablename__ = "sltune_trials"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("sltune_jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)              # 0, 1, ... within the job
    optuna_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    role: Mapped[str] = mapped_column(String(16))               # probe, frontier, grid, random, tpe
    config: Mapped[dict[str, Any]] = mapped_column(JSON)        # the knobs
    status: Mapped[str] = mapped_column(String(16))             # running, ok, oom, failed, timeout, interrupted
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)   # the TrialResult
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_device_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_host_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    predicted: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    job: Mapped[Job] = relationship(back_populates="trials")


class Fit(Base):
    """A fitted resource or throughput model, refit as trials arrive: the history is kept."""

    __tablename__ = "sltune_fits"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("sltune_jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))              # device, host, throughput
    n_trials: Mapped[int] = mapped_column(Integer)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class Worker(Base):
    """A live worker and what it can run; a queued job no live worker can run says so."""

    __tablename__ = "sltune_workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    capabilities: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class Calibration(Base):
    """A machine's rates as `sltune calibrate` measured them (sltune.machine.MachineRates), per machine (its
    fingerprint's key) and what was measured (shapes, dtype, device, threads, disk folder, optimizers, ranks: one
    key): the history is kept, the newest is used."""

    __tablename__ = "sltune_machine_rates"
    __table_args__ = (Index("ix_sltune_machine_rates_machine_workload", "machine", "workload"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine: Mapped[str] = mapped_column(String(64))
    workload: Mapped[str] = mapped_column(String(64))
    rates: Mapped[dict[str, Any]] = mapped_column(JSON)
    measured_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class Artifact(Base):
    """A file under the data directory (a trace, say), referenced by a relative path."""

    __tablename__ = "sltune_artifacts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("sltune_jobs.id", ondelete="CASCADE"), index=True)
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
