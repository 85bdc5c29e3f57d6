"""Transport names for `--kv-transport` (torch-free, so config validation and the launcher need not load torch).
`handshake` holds what each name means: the offer, the choice and the fallback."""

GRPC, CUDA_IPC, GRPC_SHM = "grpc", "cuda-ipc", "grpc-shm"
TRANSPORTS = (GRPC, CUDA_IPC, GRPC_SHM)
SHIPPER_MODES = ("auto", "on", "off")  # --kv-shipper: the grpc-shm shipper process (auto: on with CUDA)
MAX_SHIPPERS = 16  # --kv-shippers: shipper processes (ports, arena slices) per engine process, at most
MODES = ("auto", *TRANSPORTS)
