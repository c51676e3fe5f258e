"""The decode service (arrives with the service-suite issue)."""
