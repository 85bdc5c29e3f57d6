"""Tensor parallelism inside one host: the layout of heads / vocabulary / FFN over the ranks (`layout`), a rank's
slice of a checkpoint (`shard`), the collectives (`comm`), the model's TP pieces (`layers`) and the rank runtime of
ranks > 0 (`worker`). docs/design.md ("Tensor parallel") says what is wired and what is not yet."""
