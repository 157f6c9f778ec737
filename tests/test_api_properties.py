"""Property-based requests generated from the OpenAPI schema, against a real server: never a 5xx.

schemathesis turns every operation of /openapi.json into a Hypothesis strategy of requests (bodies,
paths, queries, valid and not); each one goes to a real uvicorn server with the write token.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import TOKEN, Services


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("props")
    svc = Services(tmp, f"sqlite:///{tmp / 'jobs.db'}")
    yield svc.serve()          # no worker: submitted jobs stay queued; the API itself is what is tested
    svc.stop()


CALLS: list[str] = []


def test_no_request_gets_a_server_error(api_url):
    schema = schemathesis.openapi.from_url(api_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/tune", "/jobs", "/jobs/{job_id}", "/healthz"}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            CALLS.append(case.method)
            response = case.call(base_url=api_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} {case.body!r:.300}: {response.status_code} {response.text[:500]}")

        check()
    assert len(CALLS) >= 5 * len(operations), "hypothesis generated too few requests to mean anything"
