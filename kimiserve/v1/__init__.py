"""Generated gRPC stubs of the proto package kimiserve.v1 (`make protos` regenerates them; do not edit)."""
