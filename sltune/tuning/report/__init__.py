"""What a job reports: its result and best config, its throughput figures, two jobs compared, and `sltune plan`
(a spec's configs from the prior, a job's under other limits from its fits). Reads the search's state."""
