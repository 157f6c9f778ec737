"""Real trial processes, databases (SQLite files, PostgreSQL), torchrun/gloo ranks, the store and the runner; marked
`integration` by tests/conftest.py."""
