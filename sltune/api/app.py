"""The FastAPI application: REST routes, the dashboard pages and offline API docs."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, AsyncIterator

import anyio.to_thread
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from sqlalchemy.exc import SQLAlchemyError

from sltune import __version__
from sltune.api.errors import SpecInvalid, on_request_invalid, on_spec_invalid, on_store_error, on_unexpected
from sltune.api.limits import BodyLimit, NoNul
from sltune.api.routes import router
from sltune.dashboards.pages import router as dashboard_router
from sltune.profiling import forks
from sltune.profiling.lifeline import die_with_parent
from sltune.service.ceilings import schema_maxima
from sltune.service.health import HealthWatch
from sltune.service.validation import SpecChecker
from sltune.settings import Settings
from sltune.store import Store
from sltune.tuning.spec import TuningSpec


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # sync routes run in anyio's thread pool: 40 threads by default, which on a busy server only take
        # turns at the GIL (a p99 of 500 ms at 32 clients) and outgrow the database pool
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        app.state.checker = SpecChecker(settings)
        await app.state.checker.warm_up()
        app.state.health = HealthWatch(app.state.store, settings)
        await app.state.health.start()
        # what the server imported (fastapi, sqlalchemy, pydantic; torch and transformers once a page needs a
        # model's shape) leaves objects a full garbage collection walks: with torch, 150-250 ms pauses, the whole
        # p99 at 32 clients. They live as long as the server, so they leave the collector's view.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            app.state.health.close()
            app.state.checker.close()

    # Swagger UI and ReDoc from files fastapi-offline installs: /docs works without internet access
    app = FastAPIOffline(title="sltune", version=__version__, lifespan=lifespan,
                         description="SpeedLoader tuning service: POST /tune queues a job; workers run it; "
                                     "GET /jobs/{id}/config.yaml hands the best config to training.")
    app.state.settings = settings
    app.state.store = Store(settings.db_url())
    app.add_exception_handler(SpecInvalid, on_spec_invalid)
    app.add_exception_handler(RequestValidationError, on_request_invalid)
    app.add_exception_handler(SQLAlchemyError, on_store_error)       # 503 unreachable, 507 full
    app.add_exception_handler(Exception, on_unexpected)              # a 500 is JSON too
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(NoNul)
    app.include_router(router)
    app.include_router(dashboard_router)
    app.openapi = lambda: _openapi(app)
    return app


def serving_process() -> FastAPI:
    """The app of one of `sltune serve --workers N`'s processes (uvicorn's factory): its settings come from
    the environment `serve` set, and it dies with `serve`'s supervising process, as the job worker does."""
    die_with_parent()
    forks.start()           # the spec checkers' fork server imports torch beside this process
    return create_app()


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the tuning spec's schema, which POST /tune refers to (it reads its body
    itself, to check it off the event loop)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        spec = TuningSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(spec.pop("$defs", {}))
        components["TuningSpec"] = spec
        _state_maxima(components, schema_maxima(app.state.settings))
        for operation in (op for item in schema["paths"].values() for op in item.values()):
            for code, response in operation.get("responses", {}).items():
                if code.isdigit() and int(code) >= 400:     # errors are JSON whatever the route's media type
                    media = next(iter(response.get("content", {}).values()), {})
                    response["content"] = {"application/json": media}
        schema["paths"]["/tune"]["post"]["responses"]["202"]["links"] = {"GetJob": {
            "operationId": schema["paths"]["/jobs/{job_id}"]["get"]["operationId"],
            "parameters": {"job_id": "$response.body#/job_id"}}}
    return app.openapi_schema


def _state_maxima(components: dict[str, Any], maxima: dict[str, dict[str, float]]) -> None:
    """This server's ceilings as each field's `maximum` (on its number branch, for an optional field)."""
    for model, fields in maxima.items():
        for name, ceiling in fields.items():
            prop = components[model]["properties"][name]
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") in ("integer", "number"):
                    branch["maximum"] = min(branch.get("maximum", ceiling), ceiling)
