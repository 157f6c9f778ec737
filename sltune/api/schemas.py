"""Response shapes of the REST API (the request body of POST /tune is the tuning spec itself)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class Accepted(BaseModel):
    job_id: str
    status: str


class JobSummary(BaseModel):
    id: str
    name: str
    status: str
    progress: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    best: dict[str, Any] | None = Field(None, description="the job's pick over every backend it swept: its config "
                                        "(naming its backend when the job swept several), the figure over all its "
                                        "trials and their largest peaks; never a diverged trial")
    error: str | None = None


class JobDetail(JobSummary):
    spec: dict[str, Any]
    worker_id: str | None
    attempts: int
    cancel_requested: bool
    limits: dict[str, Any] | None = Field(None, description="per resource limit: requested, applied, and by "
                                          "whom (request or server ceiling)")
    predicted: dict[str, Any] | None = None
    binding_limit: str | None = None
    models: dict[str, Any] | None = None
    stop_reason: str | None = None
    waiting_for: str | None = None
    confidence: str | None = Field(None, description="how sure the pick is, e.g. 'b=4 N=8 k=2: 1.07x [1.03, 1.11] "
                                                     "the runner-up (b=4 N=4 k=2)'")
    confirmation: dict[str, Any] | None = Field(None, description="the confirmation round: finalists, rounds, "
                                                                  "paired ratio and its 95% interval")
    depth: dict[str, Any] | None = Field(None, description="search.probe_layers: what was asked, the depths the "
                                         "probes ran and each model's full_depth_error (as in models)")
    best_by_backend: dict[str, Any] | None = Field(None, description="each backend the job swept (search.backend) "
                                                   "and its best, in best's shape with its config naming the backend, "
                                                   "plus its own predicted peaks and binding_limit; one of them is "
                                                   "best. models holds each backend's fits, a wrapped backend's as "
                                                   "'deepspeed.device', 'fsdp.throughput', ...")
    step_prior: dict[str, Any] | None = Field(None, description="where `sltune calibrate SPEC` stored this machine's "
                                              "rates: the machine they were measured on (rates, measured_at), "
                                              "whether oneshot ranked the search by the step predicted from them "
                                              "(guided), and per backend how far its trials moved that prediction "
                                              "(corrections: factor on the calibrated work, per_micro_batch_s, "
                                              "trials, error, text); null without stored rates")


class TrialOut(BaseModel):
    number: int
    role: str
    status: str
    backend: str = Field(description="what ran the trial: speedloader, deepspeed or fsdp (its config names it too)")
    config: dict[str, Any]
    predicted: dict[str, Any] = Field(description="what the job predicted before the trial ran: peak_device_bytes, "
                                      "peak_host_bytes, step_seconds, tokens_per_s, fits and over from its models; "
                                      "prior_device_bytes and prior_host_bytes from the shape; where `sltune "
                                      "calibrate SPEC` stored this machine's rates, prior_step_seconds, "
                                      "prior_tokens_per_s and prior_breakdown (shares of the step) from them, "
                                      "corrected by the trials before it")
    result: dict[str, Any] | None
    started_at: datetime
    finished_at: datetime | None
    trace_url: str | None = None


class Health(BaseModel):
    status: str = Field(description="ok, or unavailable (503) with the reasons in problems")
    database: str = Field(description="ok, or why it cannot be reached")
    workers: int | None = Field(None, description="live workers (those that touched the store within a lease)")
    free_bytes: int | None = Field(None, description="free space in the data directory")
    problems: list[str] = Field(default_factory=list, description="what makes this server unavailable")
    version: str
