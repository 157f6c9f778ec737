"""The REST routes: thin; the work is done by sltune.store, sltune.service and sltune.tuning."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse

from sltune.api.auth import require_token
from sltune.api.errors import SpecInvalid, responses
from sltune.api.examples import TUNE_EXAMPLE
from sltune.api.schemas import Accepted, Health, JobDetail, JobSummary, TrialOut
from sltune.service.jobs import job_detail, job_summary
from sltune.service.trials import trial_views
from sltune.service.validation import Busy
from sltune.backends.export import FormatMismatch, NoPick
from sltune.models.confined import OutsideModelsDir, admitted_under, within
from sltune.tuning.report.formats import export_config
from sltune.tuning.spec import TuningSpec

router = APIRouter()
JobId = Path(min_length=1, max_length=32, description="a job id, as POST /tune returned it")
Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
# POST /tune reads its body itself (checked off the event loop), so its schema is given here, with the
# examples/tiny-llama-cpu.yaml (api/examples.py) as the example /docs and /redoc show and "Try it out" sends
TUNE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/TuningSpec"}, "example": TUNE_EXAMPLE}}}}


def store(request: Request):
    return request.app.state.store


@router.post("/tune", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted,
             dependencies=[Depends(require_token)], openapi_extra=TUNE_BODY,
             responses=responses(401, 413, 422, 503, 507),
             summary="Queue a tuning job (the body is the tuning spec)")
async def post_tune(request: Request) -> Accepted:
    try:
        verdict = await request.app.state.checker.check(await request.body())    # parsed off the event loop
    except Busy as err:
        raise HTTPException(503, str(err), headers={"Retry-After": "5"}) from None
    if verdict.errors:
        raise SpecInvalid(verdict.errors)
    job = await run_in_threadpool(store(request).create_job, **verdict.job)
    return Accepted(job_id=job.id, status=job.status)


# The hot reads are async: the store works in a thread, and the response is checked and encoded on the loop
# (FastAPI sends a sync route's response through the thread pool a second time for that).
@router.get("/jobs", response_model=list[JobSummary], responses=responses(422))
async def list_jobs(request: Request, status: Status | None = Query(None),
                    limit: int = Query(100, ge=1, le=1000)) -> Any:
    jobs = await run_in_threadpool(store(request).job_summaries, limit, status)
    return [{**j, "progress": j["progress"] or {}} for j in jobs]


@router.get("/jobs/{job_id}", response_model=JobDetail, responses=responses(404, 422))
async def get_job(request: Request, job_id: str = JobId) -> Any:
    return await run_in_threadpool(lambda: job_detail(store(request), _job(request, job_id),
                                                      request.app.state.settings))


@router.get("/jobs/{job_id}/trials", response_model=list[TrialOut], responses=responses(404, 422))
def get_trials(request: Request, job_id: str = JobId) -> Any:
    _job(request, job_id)
    return [TrialOut(**t) for t in trial_views(store(request), job_id)]


@router.get("/jobs/{job_id}/trials/{number}/trace", response_class=FileResponse,
            responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                             "description": "Chrome trace event format"}, **responses(404, 422)},
            summary="The trial's Chrome/Perfetto trace (JSON)")
def get_trace(request: Request, job_id: str = JobId, number: int = Path(ge=0, le=1_000_000)) -> FileResponse:
    _job(request, job_id)
    art = store(request).artifact(job_id, number, "trace")
    root = request.app.state.settings.artifact_dir().resolve()
    path = (root / art.path).resolve() if art is not None else None
    if path is None or not path.is_relative_to(root) or not path.is_file():
        raise HTTPException(404, f"trial {number} of job {job_id} has no trace")
    return FileResponse(path, media_type="application/json", filename=f"{job_id}-trial-{number}.json")


class YamlResponse(PlainTextResponse):
    media_type = "application/yaml"


# declared as what a parser reads from it (a mapping), in the media types it is served as: YAML (best.yaml, and
# accelerate's config), JSON (DeepSpeed's config)
@router.get("/jobs/{job_id}/config.yaml", response_class=YamlResponse,
            responses={200: {"content": {
                "application/yaml": {"schema": {
                    "type": "object", "description": "format yaml: the backend and its knobs, schedule, device and "
                    "dtype; the measured and predicted peaks and throughput; the fitted models; where it came from. "
                    "format accelerate: accelerate's config (distributed_type FSDP, fsdp_config with fsdp_version 2)"}},
                "application/json": {"schema": {
                    "type": "object", "description": "format ds_config: the DeepSpeed config "
                    "deepspeed.initialize(config=...) trains with (zero_optimization, micro-batch, accumulation, "
                    "precision, optimizer, scheduler)"}}},
                "description": "the YAML SpeedLoaderConfig.from_yaml reads (format yaml), or the pick in its "
                "backend's own format"}, **responses(404, 409, 422)},
            summary="The best config, as the YAML SpeedLoaderConfig.from_yaml reads, or in its backend's format")
def get_config(request: Request, job_id: str = JobId,
               backend: Literal["speedloader", "deepspeed", "fsdp"] | None = Query(
                   None, description="that backend's pick (a job that searched several has one each); default: the "
                   "overall best"),
               fmt: Literal["yaml", "ds_config", "accelerate"] = Query(
                   "yaml", alias="format", description="yaml: best.yaml (any pick); ds_config: DeepSpeed's JSON "
                   "config (a deepspeed pick); accelerate: accelerate's FSDP2 config YAML (an fsdp pick)"),
               ) -> PlainTextResponse:
    job = _job(request, job_id)
    if job.status != "succeeded":
        raise HTTPException(409, f"job {job_id} is {job.status}; the config exists once it has succeeded")
    try:
        with within(admitted_under(job.limits)):      # the model folder read (its config) only inside models_dir
            text, media_type = export_config(TuningSpec.model_validate(job.spec), job.result, backend, fmt,
                                             flags=("backend", "format"))
    except OutsideModelsDir as err:
        raise HTTPException(409, f"model.path: {err}") from None
    except NoPick as err:
        raise HTTPException(404, str(err)) from None
    except FormatMismatch as err:       # a 422 on the parameter, as a value outside its choices is
        raise RequestValidationError([{"loc": ("query", "format"), "msg": str(err).removeprefix("format "),
                                       "type": "value_error"}]) from None
    return PlainTextResponse(text, media_type=media_type)


@router.post("/jobs/{job_id}/cancel", response_model=JobSummary, dependencies=[Depends(require_token)],
             responses=responses(401, 404, 413, 422))
def cancel(request: Request, job_id: str = JobId) -> Any:
    job = store(request).request_cancel(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job_summary(job)


@router.get("/healthz", response_model=Health,
            responses={503: {"model": Health, "description": "the database is unreachable, too few workers are "
                                                             "alive, or the data directory is short of space: "
                                                             "`problems` says which"}},
            summary="The database, the live workers and the free space (503 when any is wrong)")
async def healthz(request: Request) -> Any:
    code, body = request.app.state.health.answer()        # kept fresh by a thread of its own
    return body if code == 200 else JSONResponse(body, status_code=code)


def _job(request: Request, job_id: str):
    job = store(request).job(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job
