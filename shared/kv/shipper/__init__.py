"""The grpc-shm transport's shipper processes: `process` (the shipper itself, `python -m pdserve.kv.shipper`),
`link` (an engine process's end of it) and `frames` (what they exchange). docs/kv_transfer.md, "grpc-shm"."""
