"""What every tokenfleet gRPC server shares: bootstrap (health, reflection, graceful stop) and error mapping."""
