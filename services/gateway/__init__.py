"""The gateway service (arrives with the service-suite issue)."""
