"""Next-token sampling as a chain of small pure functions over a logits batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ruvllm_cli.engine.grammar import apply_bitmask
from ruvllm_cli.engine.request import Request
from ruvllm_cli.engine.sampling import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


def apply_penalties(row: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    params: SamplingParams, prompt_seen: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition penalty over prompt and output (as transformers does); presence and
    frequency penalties over the output only (as OpenAI defines them). `prompt_seen`:
    the prompt's distinct ids, made once per request (distinct_ids), where the set of
    a 30k-token prompt rebuilt each step took 10 ms of it. With `penalty_last_n`, all
    three over the last that many tokens of prompt and output instead, as llama.cpp's
    sampler (and Ollama's `repeat_last_n`) applies them."""
    window = params.penalty_last_n
    if window is not None:
        recent = list(output_ids[-window:])
        if len(recent) < window:
            recent = list(prompt_ids[len(recent) - window:]) + recent
        if recent:
            _repeat(row, torch.tensor(recent, dtype=torch.long, device=row.device), params.repetition_penalty)
            _count(row, recent, params)
        return row
    if params.repetition_penalty != 1.0:
        seen = distinct_ids(prompt_ids, row.device) if prompt_seen is None else prompt_seen
        if output_ids:
            seen = torch.cat([seen, torch.tensor(output_ids, dtype=torch.long, device=row.device)])
        _repeat(row, seen, params.repetition_penalty)
    if output_ids:
        _count(row, output_ids, params)
    return row


def _repeat(row: torch.Tensor, ids: torch.Tensor, penalty: float) -> None:
    """The repetition penalty on `ids` (an id twice gets the same value twice: penalised once)."""
    if penalty != 1.0:
        values = row[ids]
        row[ids] = torch.where(values > 0, values / penalty, values * penalty)


def _count(row: torch.Tensor, ids: Sequence[int], params: SamplingParams) -> None:
    """Presence and frequency penalties on `ids`, by how often each occurs there."""
    if params.presence_penalty or params.frequency_penalty:
        seen, counts = torch.tensor(ids, dtype=torch.long, device=row.device).unique(return_counts=True)
        row[seen] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)


def distinct_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=device).unique()


def filter_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if 0 < k < row.shape[-1]:
        kth = torch.topk(row, k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    return row


def filter_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return row
    sorted_logits, order = torch.sort(row, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Keep the smallest set whose mass reaches p (the token crossing p stays in), and
    # the likeliest token whatever p (float32 rounds a p below 1e-45 to 0: none kept).
    drop = cumulative - sorted_logits.softmax(-1) >= p
    drop[..., 0] = False
    return row.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def filter_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return row
    probs = row.softmax(-1)
    return row.masked_fill(probs < min_p * probs.max(), float("-inf"))


# Below this temperature sampling is greedy (vLLM's threshold): dividing by a smaller
# one overflows float32 and the softmax turns into NaN.
MIN_TEMPERATURE = 1e-5


def finite_logits(row: torch.Tensor) -> torch.Tensor:
    """NaN becomes -inf (never chosen) and +inf the largest float (the overflowed
    tokens tie for first), so a softmax over the row is always defined."""
    return torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)


# top_p without top_k looks for its set among this many likeliest tokens first (a
# sort of the whole vocabulary took 15 ms for 152k tokens on a CPU); a set beyond
# them takes the sort.
CANDIDATES = 1024


def sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a row, numerically safe for any parameters validation admits.
    Drawn by a Gumbel race over the candidates top_k / top_p leave: the likeliest of
    logit / temperature + noise, one noise value a token (torch.multinomial's draw is
    the same race, through an exponential for each token). As with multinomial, a token
    masked out (a grammar's, a padding id's) changes no other token's chance nor the
    draw: a seeded reply is the same token for token until a mask takes its token away.
    Where top_k or top_p leave candidates, their noise is a function of the step's key
    and each one's id (`token_noise`): 20 values, not the 151,936 of a whole row."""
    row = finite_logits(row)
    if params.greedy or params.temperature < MIN_TEMPERATURE:
        return int(row.argmax())
    scaled = finite_logits(row / params.temperature)
    ids, kept = _candidates(scaled, params)
    kept = filter_min_p(kept, params.min_p)
    if ids is None:
        noise = gumbel_noise(row.shape[-1], generator, kept.device)
        scores = kept.to(noise.device) + noise
    else:
        scores = kept + token_noise(ids, generator)
    best = int(scores.argmax())
    if not math.isfinite(float(scores[best])):
        return int(row.argmax())   # every token filtered out: the best one is the only sane pick
    return int(ids[best]) if ids is not None else best


def gumbel_noise(vocab: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """-log(-log(u)) for one uniform u a token; a seeded request's generator lives on
    the CPU (one per request, cheap to create), so a seed gives the same draw on any
    device. u is kept off 0 (float32's rand gives 0 once in 2^24: that token could
    not win its step)."""
    where = generator.device if generator is not None else device
    uniform = torch.rand(vocab, generator=generator, device=where).clamp_(min=torch.finfo(torch.float32).tiny)
    return uniform.log_().neg_().log_().neg_()


_M32 = 0xFFFFFFFF


def token_noise(ids: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Gumbel noise for the tokens `ids`, each value a function of the token's id and
    of the step's key (two 32-bit numbers drawn from the request's generator): a
    token's noise does not depend on which other tokens are candidates (a mask, top_k),
    and costs nothing for the ones that are not. The id goes through a 32-bit integer
    mixer (xor-shift-multiply rounds, multipliers below 2^31 so int64 never
    overflows) and its top 24 bits make u in (0, 1), as float32's rand has. On a whole
    row it would be slow (int64 arithmetic: 14 ms for 151,936 tokens against 1 ms for
    rand), hence rand's `gumbel_noise` where no filter cuts the row."""
    first, second = torch.randint(0, 2**32, (2,), generator=generator).tolist()
    x = ids.to(torch.int64) ^ first
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 12) ^ second
    x = (x * 0x297A2D39) & _M32
    x = x ^ (x >> 15)
    uniform = ((x >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    return uniform.log_().neg_().log_().neg_()


def _candidates(scaled: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What top_k then top_p leave of a row: (their ids, their logits), likeliest
    first, or (None, the whole row with the rest at -inf) where no filter applies, a
    tie at the k-th logit keeps more than k (filter_top_k keeps every tie), or top_p's
    set reaches past CANDIDATES. Either way the same tokens as filter_top_k then
    filter_top_p keep, with the same probabilities. Masked tokens (-inf) are never
    candidates: a row a grammar narrows to fewer than k tokens stays on this path."""
    vocab = scaled.shape[-1]
    k = params.top_k if 0 < params.top_k < vocab else 0
    if not k and params.top_p >= 1.0:
        return None, scaled
    if k:   # one more than k: a tie across the k-th is the (k+1)-th equal to it
        values, ids = torch.topk(scaled, k + 1)
        if bool(values[k] == values[k - 1]):
            masked = torch.finfo(values.dtype).min / 4   # a mask's -inf, made finite (finite_logits)
            if not bool(values[k - 1] < masked) or bool(values[0] < masked):
                return None, filter_top_p(filter_top_k(scaled, k), params.top_p)
            left = values > masked   # fewer than k tokens left (a mask): those
            values, ids = values[left], ids[left]
        else:
            values, ids = values[:k], ids[:k]
    else:
        values, ids = torch.topk(scaled, min(vocab, CANDIDATES))
    if params.top_p < 1.0:
        # probabilities among what top_k left (the whole row where top_k is off)
        probs = (values - (values if k else scaled).logsumexp(-1)).exp()
        cumulative = probs.cumsum(-1)
        if not k and values.shape[-1] < vocab and float(cumulative[-1]) < params.top_p:
            return None, filter_top_p(scaled, params.top_p)
        keep = cumulative - probs < params.top_p   # the token crossing p stays in
        keep[0] = True   # and the likeliest, as filter_top_p
        values, ids = values[keep], ids[keep]
    return ids, values


# A token the step's masks ruled out (a grammar, min_tokens) has logprob -inf, which JSON
# cannot carry: Python's json writes a bare -Infinity that JavaScript's, Go's and Rust's
# parsers refuse. Reported as vLLM does, at this floor (NaN too).
LOGPROB_FLOOR = -9999.0


def _reportable(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def top_logprobs(logprobs_row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logprobs_row, k)
        top = [(token, _reportable(value)) for token, value in zip(ids.tolist(), values.tolist())]
    return TokenLogprob(token_id, _reportable(float(logprobs_row[token_id])), top)


# ---- the batched mask stage: one vectorised operation per kind for the whole step ----
def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """One bitmask [rows, ceil(V/32)] for every constrained row of the step, filled by
    each row's matcher and applied in one operation. Ids past the grammar's vocabulary
    (the logits' padding) are always masked off."""
    rows = [i for i, r in enumerate(requests) if r.constrained]
    if not rows:
        return
    bitmask = torch.full((len(rows), -(-logits.shape[1] // 32)), -1, dtype=torch.int32)
    for slot, i in enumerate(rows):
        request = requests[i]
        request.grammar.fill_bitmask(bitmask, slot)  # type: ignore[union-attr]
        block = request.params.reasoning_block
        if block is not None and block.start_id is not None and not request.output_ids:
            word, bit = divmod(block.start_id, 32)   # the first token may open a reasoning block instead
            bitmask[slot, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)
    torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)  # inf + -inf is NaN
    apply_bitmask(logits, bitmask, rows)


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """OpenAI's `logit_bias`: add each request's per-token biases, all rows at once."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    width = logits.shape[-1]
    for i, request in enumerate(requests):
        for token, bias in request.params.logit_bias:
            if not 0 <= token < width:   # refused at add_request; never the whole batch's failure
                continue
            rows.append(i)
            cols.append(token)
            values.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_thinking_budgets(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """A request whose reasoning has used its thinking budget gets the block's end marker."""
    for i, request in enumerate(requests):
        budget, block = request.params.thinking_budget, request.params.reasoning_block
        if budget is not None and block is not None and request.thinking is not None and request.thinking >= budget:
            end = logits[i, block.end_id].clone()
            logits[i] = float("-inf")
            logits[i, block.end_id] = end if torch.isfinite(end) else 0.0


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """vLLM's `min_tokens`: EOS and the stop token ids masked off until a request has
    generated that many tokens."""
    width = logits.shape[-1]
    for i, request in enumerate(requests):
        if request.holds_ids:   # an EOS id past the logits (a generation_config's) is no token to hold
            logits[i, [token for token in request.held_ids if 0 <= token < width]] = float("-inf")


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first largest; a NaN counts as largest, as torch's): our
    kernel on a CPU (torch's argmax took 2.1 ms a step over 16 rows of a 152k
    vocabulary, docs/design.md section 21), else torch's."""
    from ruvllm_cli.engine.fused import DTYPE_KINDS
    from ruvllm_cli.engine.kernels import decode_kernel

    readable = logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
    kernel = decode_kernel() if readable else None
    if kernel is None or logits.dim() != 2 or not logits.is_contiguous():
        return logits.argmax(-1).tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], DTYPE_KINDS[logits.dtype],
                       out.data_ptr(), kernel.wide, torch.get_num_threads())
    return out.tolist()


@dataclass(frozen=True)
class SamplingFailure:
    """In place of a token: sampling this row raised, and only its request ends."""

    message: str


@torch.inference_mode()
def sample(logits: torch.Tensor, requests: Sequence[Request]
           ) -> tuple[list[int | SamplingFailure], list[TokenLogprob | None]]:
    """One next token per row of `logits` [S, V], with the row's request's parameters."""
    plain = all(r.params.greedy and not r.params.needs_history and r.params.logprobs is None for r in requests)
    if plain and all(r.grammar is None and not r.params.logit_bias and not r.holds_ids
                     and r.params.thinking_budget is None for r in requests):
        return greedy_tokens(logits), [None] * len(requests)   # the logits as they are: no float32 copy
    logits = logits.float()
    apply_grammar_masks(logits, requests)
    # Logprobs are the model's distribution over what the constraint allows (vLLM's
    # default, raw_logprobs): before logit_bias, min_tokens and a thinking budget, as
    # before temperature and the penalties. They had been taken after the first three.
    want_logprobs = not plain and any(r.params.logprobs is not None for r in requests)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    apply_logit_bias(logits, requests)
    apply_min_tokens(logits, requests)
    apply_thinking_budgets(logits, requests)
    if plain:
        return greedy_tokens(logits), [None] * len(requests)
    tokens: list[int | SamplingFailure] = []
    logprobs: list[TokenLogprob | None] = []
    for i, request in enumerate(requests):
        try:
            token = _sample_request(logits[i], request)
        except Exception as error:  # noqa: BLE001 - one request's failure ends that request alone
            tokens.append(SamplingFailure(f"sampling failed: {type(error).__name__}: {error}"))
            logprobs.append(None)
            continue
        tokens.append(token)
        logprobs.append(top_logprobs(raw_logprobs[i], token, request.params.logprobs)
                        if raw_logprobs is not None and request.params.logprobs is not None else None)
    return tokens, logprobs


def _sample_request(row: torch.Tensor, request: Request) -> int:
    params = request.params
    if params.needs_history:
        if params.repetition_penalty != 1.0 and params.penalty_last_n is None and request.prompt_seen is None:
            request.prompt_seen = distinct_ids(request.prompt_ids, row.device)
        row = apply_penalties(row.clone(), request.prompt_ids, request.output_ids, params, request.prompt_seen)
        for processor in params.logits_processors:
            row = processor(request.output_ids, row)
    return sample_row(row, params, request.generator)
