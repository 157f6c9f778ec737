"""The SpeedLoader runtime: parameter units, activation stores, copies and their counters."""
