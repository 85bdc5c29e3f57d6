"""The grpc-shm transport's shipper processes: `process` (the shipper itself, `python -m pdserve.kv.shipper`),
`link` (an engine process's end of it), `group` (an engine process's `--kv-shippers` links used as one) and `frames`
(what they exchange). docs/kv_transfer.md, "grpc-shm"."""
