"""The cost model: what a config needs (device, host and disk bytes, a step's traffic) known from the model's
shape before any trial, and the admission checks built on it. Imports only the spec below it."""
