"""Transport names for `--kv-transport` (torch-free, so config validation and the launcher need not load torch).
`handshake` holds what each name means: the offer, the choice and the fallback."""

GRPC, CUDA_IPC = "grpc", "cuda-ipc"
TRANSPORTS = (GRPC, CUDA_IPC)
MODES = ("auto", *TRANSPORTS)
