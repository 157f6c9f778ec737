"""The REST API (FastAPI), imported as sltune.api: thin routes over sltune's store and tuner."""
