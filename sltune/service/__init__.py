"""The tuning service's logic: workers that claim jobs, and the client CI uses; routes live in sltune/api/."""
