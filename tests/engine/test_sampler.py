"""Sampling filters and penalties as pure functions."""

import torch

from ruvllm_cli.engine.request import Request
from ruvllm_cli.engine.sampler import (apply_penalties, filter_min_p, filter_top_k, filter_top_p,
                                       sample)
from ruvllm_cli.engine.sampling import SamplingParams

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
