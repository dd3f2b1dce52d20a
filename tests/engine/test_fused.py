"""The fused decode step (engine/fused.py) against transformers' layer code in the
same engine: identical tokens and logits within float32 rounding, within a bound in
bfloat16, for the shapes the kernels index differently (GQA, MHA, one KV head, q/k/v
bias, contexts across blocks, uneven batches), and the fallbacks."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from ruvllm_cli.engine import int4_dense, kernels
from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.fused import fused_decoder, supported
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.memory import kv_dtype_bytes

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
LENGTHS = (1, 5, 16, 17, 40, 70)   # one-block, block-edge and several-block contexts, uneven


def prompts(vocab: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]


def recorded_steps(engine: LLMEngine) -> list[torch.Tensor]:
    """The engine's decode steps' logits, appended as it runs them."""
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recorded(chunks):
        logits, sampled = execute(chunks)
        if all(c.num_new_tokens == 1 for c in chunks):
            steps.append(logits.float().clone())
        return logits, sampled

    engine.runner.execute = recorded
    return steps


def run(loaded, fused: bool, quantization: Quantization = Quantization.F32, **config):
    """Greedy tokens of every prompt together, and each decode step's logits."""
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization, fused_decode=fused, **config))
    assert (engine.runner.fused is not None) == fused
    steps = recorded_steps(engine)
    results = engine.generate(prompts(), GREEDY)
    return [r.token_ids for r in results], steps, engine.runner.fused_steps


HAS_AVX512 = kernels.cpu_has(kernels.AVX512_CPU_FLAGS)
HAS_AVX512_BF16 = kernels.cpu_has(kernels.AVX512_CPU_FLAGS + ("avx512_bf16",))
# DecodeKernel.wide's levels this CPU has: AVX-512 with BF16 (2), AVX-512 (1), AVX2 (0)
LEVELS = [level for level, present in ((0, True), (1, HAS_AVX512), (2, HAS_AVX512_BF16)) if present]

WIDE = [pytest.param(2, id="avx512bf16", marks=pytest.mark.skipif(not HAS_AVX512_BF16, reason="no AVX-512 BF16 here")),
        pytest.param(1, id="avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 here")),
        pytest.param(0, id="avx2")]


@pytest.fixture(params=WIDE)
def wide(request, monkeypatch) -> int:
    """The attention's and SiLU * up's functions at one level (decode_step.c): AVX-512
    with its BF16 instructions, AVX-512, or AVX2."""
    kernel = kernels.decode_kernel()
    assert kernel is not None, "the decode kernels did not build"
    monkeypatch.setattr(kernel, "wide", request.param)
    return request.param


@pytest.mark.skipif(not kernels.cpu_has(kernels.AVX512_CPU_FLAGS), reason="no AVX-512 here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [8, 16, 1032, 16 * 4864])
def test_silu_mul_gives_the_same_bits_in_sixteen_lanes_as_in_eight(dtype, count):
    """Every form takes each value through the same operations (exp16 rounds as exp8,
    the BF16 conversion instruction as the integer rounding), so the AVX-512 ones change
    no result; counts that are not a multiple of 16 end in eight lanes. Products below
    float32's normal range (the conversion instruction takes them for zero) and a NaN
    keep their bits. All are torch's silu(g) * up within float32 rounding."""
    kernel = kernels.decode_kernel()
    torch.manual_seed(count)
    gate = (torch.randn(count) * 6).to(dtype)
    up = torch.randn(count).to(dtype)
    gate[:4] = torch.tensor([90.0, -90.0, 0.0, float("nan")])
    if count >= 16:   # silu(-90) * up: subnormal products, in a vector of their own and among normal ones
        gate[4:8], up[4:8] = -90.0, torch.tensor([0.01, 1e-3, 1e-4, -0.01])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    out = {}
    for wide in LEVELS:
        g = gate.clone()
        kernel.silu_mul(g.data_ptr(), up.data_ptr(), count, int(dtype == torch.bfloat16), wide, 2)
        out[wide] = g
    for wide in LEVELS[1:]:
        assert torch.equal(out[0].view(bits), out[wide].view(bits)), wide
    expected = torch.nn.functional.silu(gate.float()) * up.float()
    assert torch.allclose(out[LEVELS[-1]].float()[4:], expected[4:], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-6)
    if count >= 16 and dtype == torch.bfloat16:
        assert (out[LEVELS[-1]][4:8].float().abs() < torch.finfo(torch.float32).tiny).all()
        assert (out[LEVELS[-1]][4:8] != 0).all()


@pytest.mark.skipif(not kernels.cpu_has(kernels.AVX512_CPU_FLAGS), reason="no AVX-512 here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_add_rms_norm_in_sixteen_lanes_agrees_with_eight_and_with_torch(dtype, rows):
    """The residual add gives the same bits in every form (the same operation on each
    value); the norm sums its squares in another order in sixteen lanes, so it agrees
    with eight within rounding, and the BF16 conversion instruction rounds as the integer
    way (the same bits as AVX-512 alone). All are transformers' RMSNorm (x * rsqrt(mean(x^2)
    + eps), held, times the weight)."""
    kernel = kernels.decode_kernel()
    width, eps, bf16 = 896, 1e-6, int(dtype == torch.bfloat16)
    torch.manual_seed(rows)
    x, delta, weight = torch.randn(rows, width).to(dtype), torch.randn(rows, width).to(dtype), torch.randn(width).to(dtype)
    results = {}
    for wide in LEVELS:
        xs, out = x.clone(), torch.empty_like(x)
        kernel.add_rms_norm(xs.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, width, eps, bf16,
                            wide, 2)
        results[wide] = xs, out
    assert all(torch.equal(results[wide][0], x + delta) for wide in LEVELS)
    if 2 in LEVELS:
        assert torch.equal(results[1][1], results[2][1])
    summed = (x + delta).float()
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    for wide in LEVELS:
        assert torch.allclose(results[wide][1].float(), expected.float(), **tolerance)
    assert torch.allclose(results[0][1].float(), results[1][1].float(), **tolerance)


@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_rope_table_rows_are_the_rotary_modules_own_values(make_tiny_model, head_dim):
    """The fused step looks cos and sin up in tables the rotary module computed for every
    position at once: each row is what the module gives for that position in a call of
    its own, to the bit, at any batch, dtype and position (the table grows)."""
    from ruvllm_cli.engine.fused import RopeTable

    loaded = load_model(make_tiny_model(hidden_size=4 * head_dim, num_heads=4, num_kv_heads=2), "cpu", Quantization.F32)
    rotary = loaded.model.model.rotary_emb
    table = RopeTable(rotary)
    assert table.tabled
    torch.manual_seed(head_dim)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, 4 * head_dim, dtype=dtype)
        for batch, top in ((1, 100), (3, 1000), (16, 3000), (2, 9000)):
            positions = torch.randint(0, top, (1, batch))
            positions[0, 0] = top - 1
            expected = rotary(x, positions)
            got = table(x, positions, int(positions.max()))
            assert all(torch.equal(e, g) and g.is_contiguous() for e, g in zip(expected, got)), (dtype, batch)
    assert table.tables[torch.float32][0].shape[0] == 9 * 1024   # grown past the furthest position asked, 8,999


@pytest.mark.parametrize("shape", [
    {},                                             # 4 query heads over 2 KV heads, head_dim 16
    {"num_kv_heads": 4},                            # no grouping
    {"num_kv_heads": 1, "attention_bias": True},    # every head on one KV head; q/k/v with bias
    # Qwen2.5-0.5B's grouping, head_dim 64: AVX-512 holds 7 heads x 4 vectors of sums
    {"hidden_size": 448, "num_heads": 7, "num_kv_heads": 1, "intermediate_size": 64},
    {"hidden_size": 96, "num_heads": 2, "num_kv_heads": 1},     # head_dim 48: slices of 3 vectors
    {"hidden_size": 256, "num_heads": 16, "num_kv_heads": 1},   # 16 heads on one: blocks of 8
    {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2},     # head_dim 8: AVX2 on every CPU
])
def test_fused_decode_matches_the_stock_forward_in_float32(make_tiny_model, shape, wide):
    loaded = load_model(make_tiny_model(**shape), "cpu", Quantization.F32)
    fused_tokens, fused_steps, taken = run(loaded, fused=True)
    stock_tokens, stock_steps, _ = run(loaded, fused=False)
    assert fused_tokens == stock_tokens
    assert taken == len(fused_steps) == GREEDY.max_tokens - 1   # every decode-only step was fused
    assert max((a - b).abs().max().item() for a, b in zip(fused_steps, stock_steps)) < 1e-4


@pytest.mark.parametrize("shape", [
    {},
    # head_dim 64: AVX-512 BF16 scores pairs of bfloat16 values by its dot product
    {"hidden_size": 448, "num_heads": 7, "num_kv_heads": 1, "intermediate_size": 64},
])
def test_fused_decode_in_bfloat16_is_within_a_bound_of_the_stock_forward(make_tiny_model, shape, wide):
    # q4k keeps bfloat16 activations on every CPU. Rounding differs (float32 scores
    # here, bfloat16 there), so greedy paths may part on a near tie: compare the first
    # decode step, where both read the same cache. The AVX2 int4 kernel quantizes its
    # activations to int8, where a rounding apart moves a code: 4.1-10.0% of the largest
    # logit there, measured, against 1.1-1.3% with float32 sums (AVX-512). Which groups
    # moves it without making either path worse (this test's two shapes, first step):
    # groups of 64 fitted 10.0 / 4.1%, min/max 5.1 / 4.6%; of 32 fitted 7.3 / 3.3%, min/max
    # 5.1 / 4.4%, while each path stays 0.54-1.29x that logit from float32's on both
    # (random weights in 4 bits). The 0.5B bench shape: 9.7%, every greedy choice equal.
    loaded = load_model(make_tiny_model(**shape), "cpu", Quantization.Q4_K_M)
    assert loaded.dtype == torch.bfloat16
    _, fused_steps, taken = run(loaded, fused=True, quantization=Quantization.Q4_K_M)
    _, stock_steps, _ = run(loaded, fused=False, quantization=Quantization.Q4_K_M)
    first, reference = fused_steps[0], stock_steps[0]
    assert taken > 0 and first.shape == reference.shape
    bound = 0.12 if int4_dense.own_kernel() is not None and int4_dense.own_kernel().block == 32 else 0.03
    tolerance = bound * reference.abs().max().item()
    assert (first - reference).abs().max().item() <= tolerance
    # Where the greedy choices part, the fused one is a near tie in the stock logits.
    chosen = reference.gather(-1, first.argmax(-1, keepdim=True)).squeeze(-1)
    assert (reference.max(-1).values - chosen).max().item() <= tolerance


@pytest.mark.parametrize("tied", [True, False])
def test_q8_keeps_its_kv_cache_in_float16_and_both_paths_read_it_alike(make_tiny_model, tied, wide):
    # float32 activations, float16 keys and values (model_runner.kv_cache_dtype): the
    # fused kernels and the stock attention read the same rounded cache. Untied, the int8
    # table once gave bfloat16 rows, which the fused step handed its float32 kernels as
    # they were: they wrote past the step's buffers and corrupted the heap (an abort).
    loaded = load_model(make_tiny_model(tie_word_embeddings=tied), "cpu", Quantization.Q8_0)
    assert loaded.dtype == torch.float32
    assert loaded.model.get_input_embeddings()(torch.tensor([5])).dtype == torch.float32
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.Q8_0))
    assert engine.runner.cache.keys[0].dtype == torch.float16
    assert kv_dtype_bytes(Quantization.Q8_0) == engine.runner.cache.keys[0].element_size()
    fused_tokens, fused_steps, taken = run(loaded, fused=True, quantization=Quantization.Q8_0)
    stock_tokens, stock_steps, _ = run(loaded, fused=False, quantization=Quantization.Q8_0)
    assert fused_tokens == stock_tokens
    assert taken == len(fused_steps) == GREEDY.max_tokens - 1
    # The two attentions sum in other orders (a few ulps apart), and the int8 layers
    # quantize each activation row to codes: now and then an ulp moves one code by one
    # step, and that step's logits by about 1% of the largest (measured 4.9e-3 of 2.8, once
    # in 19 steps; the others 2e-7 to 7e-7).
    diffs = sorted((a - b).abs().max().item() for a, b in zip(fused_steps, stock_steps))
    assert diffs[len(diffs) // 2] < 1e-5
    assert diffs[-1] < 0.02 * max(b.abs().max().item() for b in stock_steps)


def test_a_prefix_hit_of_all_but_one_token_decodes_on_the_fused_path(make_tiny_model):
    loaded = load_model(make_tiny_model(), "cpu", Quantization.F32)
    results = []
    for fused in (True, False):
        engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.F32, fused_decode=fused))
        shared = prompts()[5][:64]
        engine.generate([shared], GREEDY)
        results.append([r.token_ids for r in engine.generate([shared + [7], shared], GREEDY)])
    assert results[0] == results[1]


def test_without_kernels_or_for_other_layers_the_stock_forward_runs(make_tiny_model, monkeypatch):
    loaded = load_model(make_tiny_model(), "cpu", Quantization.F32)
    assert fused_decoder(loaded.model, torch.float32, torch.device("cpu"), 16) is not None
    assert fused_decoder(loaded.model, torch.float16, torch.device("cpu"), 16) is None
    assert fused_decoder(loaded.model, torch.float32, torch.device("meta"), 16) is None
    other = copy.deepcopy(loaded.model.config)
    other.hidden_act = "gelu_pytorch_tanh"
    assert not supported(SimpleNamespace(config=other, model=loaded.model.model, lm_head=None), torch.float32)
    other = copy.deepcopy(loaded.model.config)
    other.model_type = "gemma"
    assert not supported(SimpleNamespace(config=other, model=loaded.model.model, lm_head=None), torch.float32)
    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    kernels.decode_kernel.cache_clear()
    try:
        assert fused_decoder(loaded.model, torch.float32, torch.device("cpu"), 16) is None
    finally:
        monkeypatch.delenv(kernels.COMPILE_ENV)
        kernels.decode_kernel.cache_clear()


# Every linear layer one of our kernels at these sizes (int4: 64-row blocks, so k/v of 64);
# q/k/v with bias, as Qwen2.
C_LOOP_SHAPE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256, "attention_bias": True}


def loop_runs(loaded, quantization: Quantization, in_c: bool, prompt_count: int, patch=None):
    """Greedy tokens, decode steps' logits and C-loop steps of one engine, its layers run
    in the one C call (`in_c`) or from Python."""
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization))
    fused = engine.runner.fused
    fused.layers_in_c = in_c
    if patch is not None:
        patch(engine)
    steps = recorded_steps(engine)
    results = engine.generate(prompts(seed=3)[:prompt_count], GREEDY)
    return [r.token_ids for r in results], steps, fused.c_steps


@pytest.mark.parametrize("quantization, prompt_count, module", [
    (Quantization.Q8_0, 1, "Int8Linear"),
    (Quantization.Q8_0, 4, "Int8Linear"),
    (Quantization.Q8_0, 6, "Int8Linear"),     # VNNI: its GEMM from five rows (AVX2: four at a time)
    (Quantization.Q4_K_M, 6, "Int4Linear"),
    (Quantization.F16, 6, "Bf16Linear"),
])
def test_the_c_layer_loop_gives_the_python_loops_bits(make_tiny_model, quantization, prompt_count, module, wide):
    """ruvllm_decode_layers calls the kernels the modules call, on the same arrays in the
    same order: the same tokens and every decode step's logits bit for bit, and it does
    run (a loop that silently fell back to Python would pass the comparison)."""
    loaded = load_model(make_tiny_model(**C_LOOP_SHAPE), "cpu", quantization)
    kinds = {type(m).__name__ for name, m in loaded.model.named_modules() if name.endswith("_proj")}
    if kinds != {module}:
        pytest.skip(f"{quantization.value} layers here are {sorted(kinds)}, not our {module} kernel")
    if module == "Int8Linear" and prompt_count > kernels.int8_kernel().rows:
        pytest.skip("this CPU's int8 GEMV takes four rows (no AVX-512 VNNI)")
    c_tokens, c_steps, ran = loop_runs(loaded, quantization, True, prompt_count)
    py_tokens, py_steps, ran_python = loop_runs(loaded, quantization, False, prompt_count)
    assert ran == len(c_steps) >= GREEDY.max_tokens - 1 and ran_python == 0   # a one-token prompt: one more
    assert c_tokens == py_tokens
    assert all(torch.equal(a, b) for a, b in zip(c_steps, py_steps))


def test_the_c_layer_loop_steps_aside_for_a_replaced_module_or_forward(make_tiny_model):
    """A module replaced in its layer (an adapter's wrapper) or a forward replaced on an
    instance runs as replaced, from Python; with the original back, the C loop again."""
    loaded = load_model(make_tiny_model(**C_LOOP_SHAPE), "cpu", Quantization.Q8_0)
    plain_tokens, _, ran = loop_runs(loaded, Quantization.Q8_0, True, 1)
    assert ran >= GREEDY.max_tokens - 1
    attn = loaded.model.model.layers[1].self_attn
    original = attn.o_proj

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 0

    def wrap(engine):
        attn._modules["o_proj"] = Wrapper(original)

    try:
        wrapped_tokens, _, ran = loop_runs(loaded, Quantization.Q8_0, True, 1, wrap)
    finally:
        attn._modules["o_proj"] = original
    assert ran == 0 and wrapped_tokens != plain_tokens

    def zero_forward(engine):
        original.forward = lambda x: torch.zeros(*x.shape[:-1], original.out_features)

    try:
        replaced_tokens, _, ran = loop_runs(loaded, Quantization.Q8_0, True, 1, zero_forward)
    finally:
        del original.forward
    assert ran == 0 and replaced_tokens == wrapped_tokens
    again_tokens, _, ran = loop_runs(loaded, Quantization.Q8_0, True, 1)
    assert ran >= GREEDY.max_tokens - 1 and again_tokens == plain_tokens


def test_the_c_layer_loop_runs_steps_where_adapters_are_loaded(make_tiny_model, tmp_path):
    """LoRA's wrappers are looked through: a step of the base model alone keeps the C loop
    (the same tokens and logits, bit for bit, as an engine without adapters: a server with
    --lora served its base model at two thirds of its speed before), and a step with an
    adapter's rows runs in C too, its updates added by the function the wrappers' forward
    calls: the same bits as the Python loop, alone and beside the base model's rows."""
    from ruvllm_cli.testing.tiny_lora import build_lora_adapter

    model_dir = make_tiny_model(**C_LOOP_SHAPE)
    loaded = load_model(model_dir, "cpu", Quantization.Q8_0)
    if {type(m).__name__ for name, m in loaded.model.named_modules() if name.endswith("_proj")} != {"Int8Linear"}:
        pytest.skip("q8 layers here are not our int8 kernel")
    plain_tokens, plain_steps, ran = loop_runs(loaded, Quantization.Q8_0, True, 2)
    assert ran >= GREEDY.max_tokens - 1
    adapter = str(build_lora_adapter(model_dir, tmp_path / "a", rank=4, alpha=8, seed=1, scale_b=4.0))
    runs = {}
    for in_c in (True, False):
        engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.Q8_0))
        engine.add_lora("a", adapter)
        fused = engine.runner.fused
        fused.layers_in_c = in_c
        steps = recorded_steps(engine)
        for adapters in (None, "a", [None, "a"]):   # the last: both kinds of rows in every step
            del steps[:]
            results = engine.generate(prompts(seed=3)[:2], GREEDY, adapters=adapters)
            runs[in_c, str(adapters)] = [r.token_ids for r in results], list(steps)
        assert fused.c_steps == (3 * len(steps) if in_c else 0) and len(steps) >= GREEDY.max_tokens - 1
        for module in loaded.model.modules():   # the next engine wraps the base layers again
            for name, child in list(module.named_children()):
                if type(child).__name__ == "LoRALinear":
                    module._modules[name] = child.base_layer
    tokens, steps = runs[True, "None"]
    assert tokens == plain_tokens and all(torch.equal(a, b) for a, b in zip(steps, plain_steps))
    assert runs[True, "a"][0] != plain_tokens
    assert runs[True, "[None, 'a']"][0] == [plain_tokens[0], runs[True, "a"][0][1]]
    for adapters in ("None", "a", "[None, 'a']"):
        (c_tokens, c_steps), (py_tokens, py_steps) = runs[True, adapters], runs[False, adapters]
        assert c_tokens == py_tokens and len(c_steps) == len(py_steps)
        assert all(torch.equal(a, b) for a, b in zip(c_steps, py_steps)), adapters


@pytest.mark.parametrize("quantization", [Quantization.Q8_0, Quantization.Q4_K_M])
def test_the_c_layer_loop_survives_kernels_turned_off_under_it(make_tiny_model, monkeypatch, quantization):
    """`--no-compile`'s turn_off after an engine is built: the int8 layers keep the
    kernel they hold (so does the loop), the int4 ones ask at each call and stop (so the
    loop steps aside); either way the engine answers as before."""
    loaded = load_model(make_tiny_model(**C_LOOP_SHAPE), "cpu", quantization)
    before, _, _ = loop_runs(loaded, quantization, True, 1)
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")   # restored after, with the loaders' caches below
    try:
        engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization))
        kernels.turn_off()
        after = engine.generate(prompts(seed=3)[:1], GREEDY)[0].token_ids
    finally:
        monkeypatch.setenv(kernels.COMPILE_ENV, "1")
        for loader in kernels.LOADERS:
            loader.cache_clear()
    assert after == before[0] or quantization == Quantization.Q4_K_M   # q4k then takes torch's int4 kernel
    assert len(after) == GREEDY.max_tokens
