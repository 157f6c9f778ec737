"""The CI client: submit a job, wait for it with progress, fetch the config (compare: sltune.tuning.report.compare)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import httpx


class ServiceError(RuntimeError):
    """The server said no (or could not be reached): the message says why."""


class Client:
    def __init__(self, server: str, token: str | None = None, timeout: float = 30.0):
        self.server = server.rstrip("/")
        token = token if token is not None else os.environ.get("SLTUNE_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as err:
            raise ServiceError(f"cannot reach {self.server}: {err}") from None
        if resp.status_code >= 400:
            raise ServiceError(f"{method} {path}: HTTP {resp.status_code}: {_detail(resp)}")
        return resp

    def submit(self, spec: dict[str, Any]) -> str:
        return self._call("POST", "/tune", json=spec).json()["job_id"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}").json()

    def trials(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/jobs/{job_id}/trials").json()

    def config_yaml(self, job_id: str, backend: str | None = None, fmt: str | None = None) -> str:
        """The job's best.yaml; with `backend` that backend's pick, with `fmt` in that format (ds_config: JSON)."""
        params = {k: v for k, v in (("backend", backend), ("format", fmt)) if v is not None}
        return self._call("GET", f"/jobs/{job_id}/config.yaml", params=params).text

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/jobs/{job_id}/cancel").json()

    def wait(self, job_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None,
             poll_s: float = 1.0, timeout_s: float | None = None) -> dict[str, Any]:
        start = time.monotonic()
        while True:
            job = self.job(job_id)
            if on_progress:
                on_progress(job)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise ServiceError(f"job {job_id} still {job['status']} after {timeout_s:g}s"
                                   + (f" (waiting for {job['waiting_for']})" if job.get("waiting_for") else ""))
            time.sleep(poll_s)


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        return resp.text[:500]
    if isinstance(detail, list):     # each msg already names its field, as the CLI would
        return "; ".join(str(e.get("msg")) for e in detail)
    return str(detail)

