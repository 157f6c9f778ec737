"""In-process tests: no server, no subprocess trial, no torchrun, no PostgreSQL; run alone with
`python -m pytest -m "not integration and not e2e"`."""
