"""The search: the candidates' trials so far, the resource models fitted to them, the strategies that propose
the next config, the confirmation round and the Optuna study. Builds on the cost model."""
