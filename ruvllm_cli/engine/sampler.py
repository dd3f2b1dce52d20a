"""Next-token sampling as a chain of small pure functions over a logits batch."""

from __future__ import annotations

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
                    params: SamplingParams) -> torch.Tensor:
    """Repetition penalty over prompt and output (as transformers does); presence and
    frequency penalties over the output only (as OpenAI defines them)."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output_ids, device=row.device).unique(return_counts=True)
        row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)
    return row


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
    # Keep the smallest set whose mass reaches p (the token crossing p stays in).
    drop = cumulative - sorted_logits.softmax(-1) >= p
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


def sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a row, numerically safe for any parameters validation admits."""
    row = finite_logits(row)
    if params.greedy or params.temperature < MIN_TEMPERATURE:
        return int(row.argmax())
    scaled = finite_logits(row / params.temperature)
    scaled = filter_min_p(filter_top_p(filter_top_k(scaled, params.top_k), params.top_p), params.min_p)
    probs = scaled.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(row.argmax())   # every token filtered out: the best one is the only sane pick
    if generator is not None:
        # A seeded request's generator lives on the CPU (one per request, cheap to
        # create): its row goes there, so a seed gives the same draw on any device.
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logprobs_row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logprobs_row, k)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(logprobs_row[token_id]), top)


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
    for i, request in enumerate(requests):
        for token, bias in request.params.logit_bias:
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
    for i, request in enumerate(requests):
        if request.holds_ids:
            logits[i, list(request.held_ids)] = float("-inf")


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
    apply_logit_bias(logits, requests)
    apply_min_tokens(logits, requests)
    apply_thinking_budgets(logits, requests)
    apply_grammar_masks(logits, requests)
    if plain:
        return greedy_tokens(logits), [None] * len(requests)
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
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
        row = apply_penalties(row.clone(), request.prompt_ids, request.output_ids, params)
        for processor in params.logits_processors:
            row = processor(request.output_ids, row)
    return sample_row(row, params, request.generator)
