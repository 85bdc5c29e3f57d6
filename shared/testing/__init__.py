"""What only tests and benchmarks use: an in-memory OTLP receiver, a private redis-server launcher and
synthetic workloads with known structure. Nothing in the services imports this package."""
