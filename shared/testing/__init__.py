"""What only tests and benchmarks use: an in-memory OTLP receiver, a private redis-server launcher,
synthetic workloads with known structure and the HF transformers reference. Nothing in the services imports
this package."""
