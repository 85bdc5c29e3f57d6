"""Generated gRPC/protobuf code for pdserve.v1 (scripts/gen_protos.py). Do not edit."""
