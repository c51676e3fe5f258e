"""tokenfleet services, installed as the tokenfleet.services namespace."""
