"""Generated gRPC/protobuf stubs for baton.v1. Do not edit: run `python -m baton.protogen`."""
# Modules (import explicitly, e.g. `from baton.v1 import decode_pb2`):
#   common_pb2, common_pb2_grpc
#   state_pb2, state_pb2_grpc
#   prefill_pb2, prefill_pb2_grpc
#   decode_pb2, decode_pb2_grpc
#   router_pb2, router_pb2_grpc
GENERATED_WITH = "grpcio-tools 1.85"
