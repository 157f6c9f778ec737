"""The REST routes: thin; the work is done by sltune.store and sltune.tuning."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Path as PathParam, Query, Request, status
from fastapi.responses import FileResponse, PlainTextResponse
from sqlalchemy import text

from sltune import __version__
from sltune.api.auth import require_token
from sltune.api.schemas import Accepted, Health, JobDetail, JobSummary, TrialOut
from sltune.service.jobs import job_detail, job_summary, submit_job
from sltune.tuning.result import export_yaml
from sltune.tuning.spec import TuningSpec

router = APIRouter()


def store(request: Request):
    return request.app.state.store


@router.post("/tune", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted,
             dependencies=[Depends(require_token)], summary="Queue a tuning job (the body is the tuning spec)")
def post_tune(spec: TuningSpec, request: Request) -> Accepted:
    job = submit_job(store(request), spec, request.app.state.settings)
    return Accepted(job_id=job.id, status=job.status)


@router.get("/jobs", response_model=list[JobSummary])
def list_jobs(request: Request, status: str | None = Query(None, max_length=16),
              limit: int = Query(100, ge=1, le=1000)) -> list[JobSummary]:
    return [job_summary(j) for j in store(request).jobs(limit=limit, status=status)]


@router.get("/jobs/{job_id}", response_model=JobDetail)
def get_job(job_id: str, request: Request) -> JobDetail:
    return job_detail(store(request), _job(request, job_id), request.app.state.settings)


@router.get("/jobs/{job_id}/trials", response_model=list[TrialOut])
def get_trials(job_id: str, request: Request) -> list[TrialOut]:
    _job(request, job_id)
    s = store(request)
    out = []
    for t in s.trials(job_id):
        has_trace = s.artifact(job_id, t.number, "trace") is not None
        out.append(TrialOut(number=t.number, role=t.role, status=t.status, config=t.config, predicted=t.predicted,
                            result=t.result, started_at=t.started_at, finished_at=t.finished_at,
                            trace_url=f"/jobs/{job_id}/trials/{t.number}/trace" if has_trace else None))
    return out


@router.get("/jobs/{job_id}/trials/{number}/trace", response_class=FileResponse,
            summary="The trial's Chrome/Perfetto trace (JSON)")
def get_trace(job_id: str, request: Request, number: int = PathParam(ge=0, le=1_000_000)) -> FileResponse:
    _job(request, job_id)
    art = store(request).artifact(job_id, number, "trace")
    root = request.app.state.settings.artifact_dir().resolve()
    path = (root / art.path).resolve() if art is not None else None
    if path is None or not path.is_relative_to(root) or not path.is_file():
        raise HTTPException(404, f"trial {number} of job {job_id} has no trace")
    return FileResponse(path, media_type="application/json", filename=f"{job_id}-trial-{number}.json")


@router.get("/jobs/{job_id}/config.yaml", response_class=PlainTextResponse,
            summary="The best config, as the YAML SpeedLoaderConfig.from_yaml reads")
def get_config(job_id: str, request: Request) -> PlainTextResponse:
    job = _job(request, job_id)
    if job.status != "succeeded":
        raise HTTPException(409, f"job {job_id} is {job.status}; the config exists once it has succeeded")
    text_ = export_yaml(TuningSpec.model_validate(job.spec), job.result)
    return PlainTextResponse(text_, media_type="application/yaml")


@router.post("/jobs/{job_id}/cancel", response_model=JobSummary, dependencies=[Depends(require_token)])
def cancel(job_id: str, request: Request) -> JobSummary:
    _job(request, job_id)
    job = store(request).request_cancel(job_id)
    return job_summary(job)


@router.get("/healthz", response_model=Health)
def healthz(request: Request) -> Health:
    try:
        with store(request).Session() as s:
            s.execute(text("SELECT 1"))
        db = "ok"
    except Exception as err:  # noqa: BLE001 - reported, not raised
        raise HTTPException(503, f"database unreachable: {type(err).__name__}") from None
    return Health(status="ok", database=db, version=__version__)


def _job(request: Request, job_id: str):
    job = store(request).job(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job
