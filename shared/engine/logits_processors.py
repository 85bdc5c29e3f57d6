"""Per-request logit changes before sampling, batched over the rows of one step: repetition / frequency /
presence penalties, logit_bias, the min_tokens EOS ban and the structured-output token mask.

Order (each on float32 logits [S, V]): repetition penalty (HF / vLLM, on the model's logits) -> frequency and
presence penalties (OpenAI) -> logit_bias -> min_tokens ban -> grammar mask. Log-probabilities are reported from the
unprocessed logits (the model's distribution, see `pdserve.engine.sampling`).

Every change is a few tensor ops over the whole batch, built from the sequences' token ids once per step (one
host -> device copy per kind); a step without any request that asks for them builds nothing (`LogitsPlan.build`
returns None)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sequence import Sequence
from pdserve.engine.structured import fill_bitmasks

NEG_INF = float("-inf")


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, L] int64 padded with 0, valid [R, L] bool) of ragged token id lists."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            valid[i, : len(r)] = True
    return ids.to(device, non_blocking=True), valid.to(device, non_blocking=True)


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each row's list."""
    ids, valid = _padded(rows, device)
    counts = torch.zeros((len(rows), vocab_size), dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, valid.float())


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor | None,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits [R, V] (a new tensor). output_counts [R, V]: generated-token counts; seen [R, V] bool:
    tokens of prompt or output (repetition penalty); repetition / frequency / presence [R, 1]."""
    x = logits
    if repetition is not None and seen is not None:
        scaled = torch.where(x > 0, x / repetition, x * repetition)
        x = torch.where(seen, scaled, x)
    return x - frequency * output_counts - presence * (output_counts > 0).float()


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] bool: the tokens `bitmask` [R, ceil(V / 32)] int32 allows (bit j of word w allows token
    32 w + j, xgrammar's layout). Device ops only, no host sync (a decode CUDA graph captures it)."""
    bits = (1 << torch.arange(8, dtype=torch.int32, device=bitmask.device)).to(torch.uint8)  # no host copy: capturable
    # little-endian words: byte k of word w holds tokens 32 w + 8 k ... + 7 (one byte temporary a token, not four)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4 ceil(V / 32)]
    return (as_bytes.unsqueeze(-1) & bits).ne(0).flatten(1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] with the tokens not allowed by `bitmask` [R, ceil(V / 32)] int32 set to -inf, in place."""
    return logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), NEG_INF)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [R, V] with the tokens `bitmask` [R, ceil(V / 32)] does not allow at -inf (the decode
    graph's masked greedy draw: the model's logits stay as computed). Graph-capturable."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), NEG_INF)


@dataclass
class LogitsPlan:
    """What one step changes, for the rows (of the sampled rows) that ask. Build it with `build`."""

    penalty_rows: list[int]
    output_ids: list[list[int]]
    prompt_ids: list[list[int]] | None  # only when some row has a repetition penalty
    repetition: list[float]
    frequency: list[float]
    presence: list[float]
    additive: tuple[list[int], list[int], list[float]]  # (rows, token ids, values): logit_bias and -inf bans
    grammar_rows: list[int]
    bitmask: torch.Tensor | None  # [len(grammar_rows), ceil(V / 32)] int32 (host)

    @staticmethod
    def build(seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int]) -> LogitsPlan | None:
        """The plan for sampled rows `seqs` (row r of the logits is seqs[r]); None when no row asks for anything.
        Fills the grammar masks here, on the host (call it while the device computes the step)."""
        if not any(s.sampling.processes_logits for s in seqs):
            return None
        pen_rows: list[int] = []
        outputs: list[list[int]] = []
        prompts: list[list[int]] = []
        rep, freq, pres = [], [], []
        add_rows: list[int] = []
        add_ids: list[int] = []
        add_vals: list[float] = []
        grammar_rows: list[int] = []
        for r, s in enumerate(seqs):
            sp = s.sampling
            if sp.has_penalties:
                pen_rows.append(r)
                outputs.append(s.output_token_ids())
                prompts.append(s.prompt_token_ids[: s.num_prompt_tokens - s.num_prior_output_tokens])
                rep.append(sp.repetition_penalty)
                freq.append(sp.frequency_penalty)
                pres.append(sp.presence_penalty)
            for t, b in sp.logit_bias.items():
                add_rows.append(r)
                add_ids.append(t)
                add_vals.append(b)
            if s.grammar is not None:
                grammar_rows.append(r)
            elif s.num_output_tokens < sp.min_tokens:  # a grammar decides itself when the output may end
                banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
                for t in banned:
                    if 0 <= t < vocab_size:
                        add_rows.append(r)
                        add_ids.append(t)
                        add_vals.append(NEG_INF)
        bitmask = None
        if grammar_rows:
            bitmask = torch.full((len(grammar_rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
            fill_bitmasks([g for r in grammar_rows if (g := seqs[r].grammar) is not None], bitmask)
        any_rep = any(p != 1.0 for p in rep)
        return LogitsPlan(
            pen_rows,
            outputs,
            prompts if any_rep else None,
            rep,
            freq,
            pres,
            (add_rows, add_ids, add_vals),
            grammar_rows,
            bitmask,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits [S, V] (a new tensor; `logits` is left as the model produced it)."""
        device, vocab = logits.device, logits.shape[-1]
        x = logits.float().clone()
        if self.penalty_rows:
            rows = torch.tensor(self.penalty_rows, dtype=torch.long, device=device)
            counts = token_counts(self.output_ids, vocab, device)  # [P, V]
            seen = rep = None
            if self.prompt_ids is not None:
                seen = (counts + token_counts(self.prompt_ids, vocab, device)) > 0
                rep = torch.tensor(self.repetition, device=device).unsqueeze(-1)
            freq = torch.tensor(self.frequency, device=device).unsqueeze(-1)
            pres = torch.tensor(self.presence, device=device).unsqueeze(-1)
            x[rows] = apply_penalties(x[rows], counts, seen, rep, freq, pres)
        add_rows, add_ids, add_vals = self.additive
        if add_rows:
            index = (torch.tensor(add_rows, device=device), torch.tensor(add_ids, device=device))
            x.index_put_(index, torch.tensor(add_vals, dtype=x.dtype, device=device), accumulate=True)
        if self.bitmask is not None:
            rows = torch.tensor(self.grammar_rows, dtype=torch.long, device=device)
            x[rows] = apply_bitmask(x[rows], self.bitmask.to(device, non_blocking=True))
        return x
