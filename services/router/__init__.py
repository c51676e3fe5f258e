"""The router service (arrives with the service-suite issue)."""
