"""Helpers the test layers share; nothing here is collected (no test_*.py)."""
