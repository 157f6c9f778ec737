"""The CLI as a user runs it, a real server, the browser, docker and the README's flows; marked `e2e` by
tests/conftest.py."""
