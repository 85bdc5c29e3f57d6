"""Tensor parallelism inside one host: the layout of heads / vocabulary / FFN over the ranks (`layout`), a rank's
slice of a checkpoint (`shard`), the collectives (`comm`), the model's TP pieces (`layers`), the step messages and
the followers' loop (`worker`), rank 0's start and watch of the other ranks (`supervisor`) and a follower
process's main (`follower`). docs/design.md ("Tensor parallel") says what is wired and what is not yet."""
