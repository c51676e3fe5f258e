"""The registry service (arrives with the service-suite issue)."""
