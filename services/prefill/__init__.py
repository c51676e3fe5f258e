"""The prefill service (arrives with the service-suite issue)."""
