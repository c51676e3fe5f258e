"""Generated protobuf/gRPC code for protos/tokenfleet/v1 (scripts/gen_protos.py; never edit by hand)."""
