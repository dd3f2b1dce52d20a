"""Sampling filters and penalties as pure functions."""

import math

import pytest
import torch

from ruvllm_cli.engine import kernels
from ruvllm_cli.engine.request import Request
from ruvllm_cli.engine.sampler import (CANDIDATES, SamplingFailure, _candidates, apply_penalties,
                                       distinct_ids, filter_min_p, filter_top_k, filter_top_p, greedy_tokens, sample,
                                       sample_row)
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import UsageError

ROW = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


def kept(row):
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_best():
    assert kept(filter_top_k(ROW.clone(), 2)) == [0, 1]
    assert kept(filter_top_k(ROW.clone(), 0)) == [0, 1, 2, 3]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(filter_top_p(ROW.clone(), 0.5)) == [0]
    assert kept(filter_top_p(ROW.clone(), 0.7)) == [0, 1]
    assert kept(filter_top_p(ROW.clone(), 0.8)) == [0, 1, 2]


def test_min_p_is_relative_to_the_best():
    assert kept(filter_min_p(ROW.clone(), 0.4)) == [0, 1]


def test_penalties():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = torch.tensor([1.0, -1.0, 2.0, 0.0])
    out = apply_penalties(row.clone(), prompt_ids=[0], output_ids=[1, 1], params=params)
    assert out.tolist() == [0.5, -2.0 - 0.5 - 0.5, 2.0, 0.0]


def test_penalties_with_the_prompt_s_ids_made_once_are_the_same():
    row = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    prompt, output = [3, 9, 9, 40, 3], [9, 11, 11, 2]
    once = apply_penalties(row.clone(), prompt, output, params, distinct_ids(prompt, row.device))
    assert torch.equal(once, apply_penalties(row.clone(), prompt, output, params))
    expected = row.clone()
    for i in (2, 3, 9, 11, 40):   # repetition: each seen id once, whatever its count
        expected[i] = expected[i] / 1.3 if expected[i] > 0 else expected[i] * 1.3
    expected[9] -= 0.5 + 0.2
    expected[11] -= 0.5 + 0.4
    expected[2] -= 0.5 + 0.2
    assert torch.allclose(once, expected)


def test_penalties_over_the_last_n_tokens_look_at_those_alone():
    """Ollama's repeat_last_n (llama.cpp's penalty window): all three penalties over the
    last N tokens of prompt and output, a token's count within them."""
    row = torch.randn(50, generator=torch.Generator().manual_seed(2)) * 3
    prompt, output = [3, 9, 9, 40, 3], [9, 11, 11, 2]

    def expected(window, rep=1.3, presence=0.5, frequency=0.2):
        out = row.clone()
        recent = (prompt + output)[-window:]
        for i in set(recent):
            out[i] = out[i] / rep if out[i] > 0 else out[i] * rep
            out[i] -= presence + frequency * recent.count(i)
        return out

    for window in (1, 2, 5, 9, 100):
        params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                penalty_last_n=window)
        assert torch.allclose(apply_penalties(row.clone(), prompt, output, params), expected(window)), window
    # the prompt alone, before the first token
    params = SamplingParams(repetition_penalty=1.3, penalty_last_n=3)
    out = apply_penalties(row.clone(), prompt, [], params)
    assert torch.allclose(out, _repeat_only(row, [9, 40, 3]))
    with pytest.raises(UsageError, match="penalty_last_n must be at least 1"):
        SamplingParams(penalty_last_n=0)


def _repeat_only(row, ids, rep=1.3):
    out = row.clone()
    for i in set(ids):
        out[i] = out[i] / rep if out[i] > 0 else out[i] * rep
    return out


def reference_probs(scaled, params):
    """The filter chain over the whole row, as sample_row's candidates must match."""
    kept_row = filter_top_p(filter_top_k(scaled.clone(), params.top_k), params.top_p)
    return filter_min_p(kept_row, params.min_p).softmax(-1)


ROWS = {"peaked": torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 6,
        "flat": torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 0.01,   # top_p past CANDIDATES
        "ties": torch.tensor([5.0, 4.0, 4.0, 4.0, 3.0] + [0.0] * 95)}                    # ties at the k-th


@pytest.mark.parametrize("row", ROWS, ids=str)
@pytest.mark.parametrize("top_k", [0, 1, 2, 7, 50])
@pytest.mark.parametrize("top_p", [1.0, 0.999, 0.9, 0.5, 1e-300])
@pytest.mark.parametrize("min_p", [0.0, 0.1])
def test_the_candidates_keep_what_the_filter_chain_keeps(row, top_k, top_p, min_p):
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    scaled = ROWS[row] / 0.7
    ids, kept_logits = _candidates(scaled, params)
    probs = filter_min_p(kept_logits, min_p).softmax(-1)
    ours = probs if ids is None else torch.zeros_like(scaled).index_put_((ids,), probs)
    expected = reference_probs(scaled, params)
    if row == "ties":   # which of equal tokens crosses p is the sort's pick: the same probabilities
        ours, expected = ours.sort().values, expected.sort().values
    assert torch.equal(ours > 0, expected > 0)
    assert torch.allclose(ours, expected, atol=1e-6)
    if row == "flat" and top_k == 0 and top_p == 0.9:
        assert ids is None and int((expected > 0).sum()) > CANDIDATES   # the whole-row path


@pytest.mark.parametrize("knobs, expected", [
    ({}, [0.5, 0.0, 0.25, 0.15, 0.1, 0.0]),                       # the whole row
    ({"top_k": 3}, [0.5 / 0.9, 0.0, 0.25 / 0.9, 0.15 / 0.9, 0.0, 0.0]),   # topk's candidates
    ({"top_p": 0.7}, [0.5 / 0.75, 0.0, 0.25 / 0.75, 0.0, 0.0, 0.0]),   # top_p's, without top_k
])
def test_draws_follow_the_probabilities(knobs, expected):
    row = torch.tensor([0.5, 0.0, 0.25, 0.15, 0.1, 0.0]).log()
    params = SamplingParams(temperature=1.0, **knobs)
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample_row(row, params, generator) for _ in range(20000)]), minlength=6)
    assert torch.allclose(counts / 20000, torch.tensor(expected), atol=0.012)
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0)
    # a seed replays
    assert [sample_row(row, params, torch.Generator().manual_seed(5)) for _ in range(3)] == \
        [sample_row(row, params, torch.Generator().manual_seed(5)) for _ in range(3)]


def test_a_mask_narrower_than_top_k_keeps_the_free_draw():
    """A grammar that leaves 5 tokens under top_k 20 (ties at -inf past the 5th): the
    candidates are those 5, each with the noise it has in the free row, so the draw is
    the free one wherever the free one is allowed."""
    row = torch.randn(1000, generator=torch.Generator().manual_seed(7)) * 2
    allowed = row.argsort(descending=True)[torch.tensor([0, 2, 5, 11, 17])]
    masked = torch.full_like(row, float("-inf"))
    masked[allowed] = row[allowed]
    params = SamplingParams(temperature=1.5, top_k=20)
    same = 0
    for seed in range(300):
        free = sample_row(row, params, torch.Generator().manual_seed(seed))
        constrained = sample_row(masked, params, torch.Generator().manual_seed(seed))
        assert constrained in allowed.tolist()
        if free in allowed.tolist():
            assert constrained == free
            same += 1
    assert same > 60


def test_token_noise_is_a_function_of_the_id_and_the_step_s_key():
    from ruvllm_cli.engine.sampler import token_noise

    ids = torch.tensor([3, 151_000, 7, 42])
    whole = token_noise(torch.arange(151_936), torch.Generator().manual_seed(9))
    assert torch.equal(token_noise(ids, torch.Generator().manual_seed(9)), whole[ids])
    assert not torch.equal(token_noise(ids, torch.Generator().manual_seed(10)), whole[ids])
    # Gumbel-distributed: mean 0.5772 (Euler's constant), variance pi^2 / 6
    assert abs(float(whole.mean()) - 0.5772) < 0.01 and abs(float(whole.var()) - math.pi ** 2 / 6) < 0.03


@pytest.mark.parametrize("knobs", [{}, {"top_k": 50}, {"min_p": 0.05}], ids=str)
def test_a_masked_token_changes_no_other_draw(knobs):
    """As with torch.multinomial: masking tokens out (a grammar, padding ids) leaves the
    same seeded draw wherever it did not take the drawn token away, so a constrained
    reply is token for token the free one until the constraint bites."""
    row = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 2
    masked = row.clone()
    outside = row.argsort()[:900]   # below the top 50: top_k's candidates stay the same
    taken = outside[torch.randperm(900, generator=torch.Generator().manual_seed(5))[:300]]
    masked[taken] = float("-inf")
    params = SamplingParams(temperature=1.0, **knobs)
    same = 0
    for seed in range(200):
        free = sample_row(row, params, torch.Generator().manual_seed(seed))
        constrained = sample_row(masked, params, torch.Generator().manual_seed(seed))
        assert constrained not in set(taken.tolist())
        if free not in set(taken.tolist()):
            assert constrained == free
            same += 1
    assert same > 150


def test_logits_processor_hook_masks_tokens():
    def only_token_3(ids, row):
        mask = torch.full_like(row, float("-inf"))
        mask[3] = 0
        return row + mask

    request = Request(prompt_ids=[1], params=SamplingParams(temperature=0.0, logits_processors=[only_token_3]))
    tokens, _ = sample(torch.tensor([[5.0, 4.0, 3.0, 0.0]]), [request])
    assert tokens == [3]


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1, 50)
    picks = []
    for _ in range(2):
        request = Request(prompt_ids=[1], params=SamplingParams(temperature=1.0, seed=3))
        request.generator = torch.Generator().manual_seed(3)
        picks.append([sample(logits, [request])[0][0] for _ in range(5)])
    assert picks[0] == picks[1]


# Values validation admits that once made the softmax NaN and killed the engine (issue 18).
EXTREME = [
    dict(temperature=1e-40), dict(temperature=1e-300), dict(temperature=5e-324),
    dict(top_p=1e-300), dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
    dict(temperature=1e-8, top_k=5), dict(min_p=1.0), dict(temperature=2.0, top_p=1e-300, min_p=1.0),
    dict(presence_penalty=2.0, frequency_penalty=-2.0, temperature=1e-30),
]


@pytest.mark.parametrize("knobs", EXTREME, ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()))
def test_extreme_but_valid_parameters_always_sample_a_real_token(knobs):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 30
    logits[:, 1:6] = -5.0         # the seen tokens: no penalty can lift them past +inf below
    logits[1, 7] = float("inf")   # an overflowed logit must not poison the softmax either
    requests = [Request(prompt_ids=[1, 2, 3], params=SamplingParams(**knobs)) for _ in range(2)]
    for request in requests:
        request.output_ids += [4, 4, 5]
    tokens, _ = sample(logits, requests)
    assert all(isinstance(t, int) and 0 <= t < 64 for t in tokens)
    assert tokens[1] == 7


def test_nan_logits_are_never_chosen():
    row = torch.tensor([float("nan"), 1.0, float("nan"), 0.5])
    request = Request(prompt_ids=[1], params=SamplingParams(temperature=1.0, seed=0))
    request.generator = torch.Generator().manual_seed(0)
    assert {sample(row.unsqueeze(0), [request])[0][0] for _ in range(20)} <= {1, 3}


def test_a_failing_row_fails_alone():
    def broken(ids, row):
        raise RuntimeError("boom")

    requests = [Request(prompt_ids=[1], params=SamplingParams(temperature=1.0, logits_processors=[broken])),
                Request(prompt_ids=[1], params=SamplingParams(temperature=0.0))]
    tokens, _ = sample(torch.tensor([[0.0, 1.0], [2.0, 1.0]]), requests)
    assert isinstance(tokens[0], SamplingFailure) and "boom" in tokens[0].message
    assert tokens[1] == 0


@pytest.fixture(params=[pytest.param(1, id="avx512", marks=pytest.mark.skipif(
    not kernels.cpu_has(kernels.AVX512_CPU_FLAGS), reason="no AVX-512 here")), pytest.param(0, id="avx2")])
def wide(request, monkeypatch):
    """The argmax kernel's AVX-512 form (one pass, a row split over the threads) or its
    AVX2 one (decode_step.c)."""
    kernel = kernels.decode_kernel()
    assert kernel is not None, "the decode kernels did not build"
    monkeypatch.setattr(kernel, "wide", request.param)
    return request.param


@pytest.mark.parametrize("shape", [(1, 151936), (16, 1000), (3, 37), (2, 8), (5, 9), (1, 4099), (2, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax(shape, dtype, wide):
    torch.manual_seed(shape[1])
    logits = torch.randn(*shape).to(dtype)
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_take_the_first_of_ties_and_of_nans_as_torch_does(dtype, wide):
    logits = torch.randn(5, 300, dtype=dtype)
    logits[0, 40] = logits[0, 250] = logits[0].max() + 1       # a tie: the first
    logits[1, 17] = logits[1, 200] = float("nan")              # NaNs: the first
    logits[2] = float("-inf")                                 # nothing but -inf: 0
    logits[3, 299] = float("inf")                             # the tail past the last 8
    logits[4] = 0.0
    logits[4, 3] = -0.0                                       # -0 and +0 tie
    assert greedy_tokens(logits) == logits.argmax(-1).tolist() == [40, 17, 0, 299, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_take_the_first_tie_across_lanes_chains_and_pieces(dtype, wide):
    """The AVX-512 form keeps a best value per lane in four chains of sixteen, and splits
    a lone row over two threads: a tie whose later copy sits in an earlier lane, chain
    or piece must still give the first index."""
    n = 151936 + 40   # 64-value blocks, then two of 16 and eight alone; halves of 1,187 blocks, one of 16, four alone
    logits = torch.randn(6, n, dtype=dtype)
    top = logits.max() + 1
    logits[0, 63] = logits[0, 64] = top            # the first is in chain 3's last lane, the second chain 0's first
    logits[1, 69] = logits[1, 5] = top             # the same lane of one chain, a block apart
    logits[2, n // 2 + 3] = logits[2, 100_000] = top   # the second piece only
    logits[3, 10] = logits[3, n - 1] = top         # first and last of the row
    logits[4, n - 2] = float("nan")                # a NaN in the second piece, a larger value before it
    logits[4, 7] = top
    logits[5] = float("-inf")
    logits[5, n - 5] = -1e30                       # the only finite value sits in the scalar tail
    expected = [63, 5, n // 2 + 3, 10, n - 2, n - 5]
    assert logits.argmax(-1).tolist() == expected
    assert greedy_tokens(logits) == expected
    for r in range(6):   # one row alone: split over the threads
        assert greedy_tokens(logits[r:r + 1].contiguous()) == [expected[r]]
