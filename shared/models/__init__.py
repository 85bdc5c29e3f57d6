"""Local model builders (no model hub): random-init HF checkpoints with a real tokenizer (tests, the demo
fallback) and a tiny Llama trained on the shipped corpus."""
