"""What only tests and benchmarks use: an in-memory OTLP receiver, a private redis-server launcher, `pdserve up`
as a child process (its banner read, stopped as Ctrl-C does), synthetic workloads with known structure and the HF
transformers reference. Nothing in the services imports this package."""
