"""The prefill role of the engine worker (services/worker): `python -m tokenfleet.services.prefill`."""
