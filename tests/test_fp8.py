"""The FP8 quantizer (models/fp8.py) against a reference written here: e4m3fn rounding from the table of its
256 codes (nearest, ties to the even code), block scales amax / 448, zero blocks, pow2 scales, TP shards."""

import math

import pytest
import torch

from megatron_grpo.models import fp8

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
FINITE = [(float(v), c) for c, v in enumerate(CODES.tolist()) if math.isfinite(v)]


def ref_e4m3(value: float) -> float:
    """Nearest finite e4m3fn value; a tie goes to the value whose code is even (mantissa LSB 0); saturates."""
    value = max(-448.0, min(448.0, value))
    best = min(FINITE, key=lambda vc: (abs(vc[0] - value), vc[1] % 2, vc[1]))
    return best[0] + 0.0  # -0.0 -> 0.0


def ref_quantize(w: torch.Tensor, bn: int, bk: int, pow2: bool = False):
    w = w.to(torch.bfloat16).double()
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.float64)
    scales = torch.zeros(n // bn, k // bk, dtype=torch.float64)
    for i in range(n // bn):
        for j in range(k // bk):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = float(blk.abs().max())
            scale = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)) if amax else 1.0
            if pow2 and amax:
                scale = 2.0 ** math.ceil(math.log2(scale))
            scales[i, j] = scale
            for a in range(bn):
                for b in range(bk):
                    x = float(torch.tensor(float(blk[a, b]), dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))
                    q[i * bn + a, j * bk + b] = ref_e4m3(x)
    return q, scales


def test_rounding_on_e4m3_boundaries_ties_to_even_and_saturation():
    grid = sorted({v for v, _ in FINITE if 0 <= v <= 448})
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    near = [m + d for m in mids[::7] for d in (-1e-3 * m, 1e-3 * m)]
    values = torch.tensor(grid + mids + near + [449.0, 470.0, 1e6], dtype=torch.float64)
    values = torch.cat([values, -values])
    # one block, scale exactly 1: put 448 in it so amax / 448 = 1, and keep values inside the block exactly bf16
    w = torch.cat([values, torch.tensor([448.0])]).to(torch.bfloat16).float()
    pad = -w.numel() % 8
    w = torch.cat([w, torch.zeros(pad)]).reshape(1, -1)
    w = w.expand(8, -1).contiguous()
    q, scale = fp8.quantize_weight(w, (8, w.shape[1]))
    assert scale.shape == (1, 1)
    # values above 448 make amax > 448: the scale is then amax / 448, not 1; check against the reference
    ref_q, ref_s = ref_quantize(w, 8, w.shape[1])
    assert torch.equal(scale.double(), ref_s)
    assert torch.equal(q.float().double(), ref_q)
    # a block whose amax is 448 exactly: scale 1, every grid value exact, every midpoint to the even code
    inside = torch.tensor(grid + mids, dtype=torch.float32)
    inside = torch.cat([inside, -inside]).to(torch.bfloat16).float()
    inside = torch.cat([inside, torch.zeros(-inside.numel() % 4)]).reshape(4, -1)
    q, scale = fp8.quantize_weight(inside, (4, inside.shape[1]))
    assert scale.item() == 1.0
    expect = torch.tensor([ref_e4m3(float(v)) for v in inside.flatten()]).reshape(inside.shape)
    assert torch.equal(q.float(), expect)
    assert torch.equal(fp8.dequantize_weight(q, scale)[:, :len(grid)], expect[:, :len(grid)])
    # the reference itself, on hand-picked ties: 1.0625 -> 1.0 (mantissa 000), 1.1875 -> 1.25 (010), 248 -> 256
    assert [ref_e4m3(v) for v in (1.0625, 1.1875, 248.0, 2 ** -10, 1.5 * 2 ** -9)] == [1.0, 1.25, 256.0, 0.0, 2 ** -8]


def test_block_scales_zero_block_pow2_and_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 12, generator=g) * torch.tensor([0.01, 3.0, 100.0]).repeat_interleave(4)
    w[4:, 4:8] = 0.0  # one zero block: scale 1, q 0
    for pow2 in (False, True):
        q, scale = fp8.quantize_weight(w, (4, 4), pow2=pow2)
        ref_q, ref_s = ref_quantize(w, 4, 4, pow2)
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (2, 3)
        assert torch.equal(scale.double(), ref_s), pow2
        assert torch.equal(q.float().double(), ref_q), pow2
        assert scale[1, 1] == 1 and not q.float()[4:, 4:8].any()
        if pow2:
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        deq = fp8.dequantize_weight(q, scale)
        ref_w = w.to(torch.bfloat16).float()
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's scale range
        blocks_amax = ref_w.reshape(2, 4, 3, 4).abs().amax(dim=(1, 3)).repeat_interleave(4, 0).repeat_interleave(4, 1)
        assert ((deq - ref_w).abs() <= blocks_amax * 2 ** -4 + 1e-12).all()


def test_block_scales_divide_exactly_on_every_device():
    """Every finite positive bf16 amax: the scales are true fp32 division (as vLLM's quantization kernels
    compute them), on the CPU and, where there is one, on CUDA, where division by a Python scalar is a
    reciprocal multiply, 1 ulp off for about half of them."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ref = (amax.double() / 448.0).float()  # fp64 then fp32: exact for a quotient of fp32 values (53 >= 2 * 24 + 2)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        assert torch.equal(fp8.block_scales(amax.to(device), False).cpu(), ref), device
        assert torch.equal(fp8.block_scales(amax.to(device), True).cpu(), fp8.block_scales(amax, True)), device


def test_activation_groups_per_token():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 16, generator=g) * 5
    x[1, 0, 8:] = 0
    q, scale = fp8.quantize_activation(x, 8)
    assert scale.shape == (3, 2, 2) and scale[1, 0, 1] == 1
    for idx in [(0, 0), (1, 0), (2, 1)]:
        for grp in range(2):
            seg = x[idx][grp * 8:(grp + 1) * 8].reshape(1, 8)
            ref_q, ref_s = ref_quantize(seg.expand(1, 8), 1, 8)
            assert scale[idx][grp].item() == ref_s.item()
            assert torch.equal(q[idx][grp * 8:(grp + 1) * 8].float().double(), ref_q[0])
    deq = fp8.fake_quantize_activation(x, 8)
    assert torch.equal(deq, fp8.dequantize_activation(q, scale))


def test_tp_shards_quantize_to_the_shards_of_the_whole_weight():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 32, generator=g)
    q, s = fp8.quantize_weight(w, (4, 8))
    for tp in (2, 4):
        for rank in range(tp):  # column-parallel: rows split; row-parallel: columns split
            rows = slice(rank * 16 // tp, (rank + 1) * 16 // tp)
            qr, sr = fp8.quantize_weight(w[rows], (4, 8))
            assert torch.equal(qr.view(torch.uint8), q[rows].view(torch.uint8))
            assert torch.equal(sr, s[rank * 4 // tp:(rank + 1) * 4 // tp])
            cols = slice(rank * 32 // tp, (rank + 1) * 32 // tp)
            qc, sc = fp8.quantize_weight(w[:, cols], (4, 8))
            assert torch.equal(qc.view(torch.uint8), q[:, cols].view(torch.uint8))
            assert torch.equal(sc, s[:, rank * 4 // tp:(rank + 1) * 4 // tp])


def test_layers_kept_in_bf16():
    recipe = fp8.Fp8Recipe(num_first_layers_in_bf16=1, num_last_layers_in_bf16=2)
    assert list(fp8.quantized_layer_ids(6, recipe)) == [1, 2, 3]


def test_fp8_forward_patches_the_decoder_linears_only_and_restores_them(tiny_dense, megatron_single, monkeypatch):
    from megatron_grpo.models import build_from_hf, forward_logits, unwrap

    model, _ = build_from_hf(tiny_dense)
    gpt = unwrap(model)
    recipe = fp8.Fp8Recipe(weight_block_size=(32, 32), activation_block_size=32, num_first_layers_in_bf16=1)
    names = [n for n, _ in fp8.fp8_linears(gpt, recipe)]
    assert len(names) == 4 * 3 and not any(n.startswith("decoder.layers.0.") for n in names)
    assert {n.split(".", 3)[3] for n in names} == {"self_attention.linear_qkv", "self_attention.linear_proj",
                                                   "mlp.linear_fc1", "mlp.linear_fc2"}
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    calls = []
    fc1 = gpt.decoder.layers[2].mlp.linear_fc1
    hook = fc1.register_forward_hook(lambda m, args, out: calls.append(dict(x=args[0].detach(), y=out[0].detach())))
    with torch.no_grad():
        plain = forward_logits(model, ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = forward_logits(model, ids)
            with fp8.fp8_forward(gpt, recipe) as weights:
                quantized = forward_logits(model, ids)
        again = forward_logits(model, ids)
    hook.remove()
    seen = calls[2]  # plain, bf16, fp8, again
    assert torch.equal(plain, again)  # the linears are restored
    # the hooked fc1 output is the FP8 GEMM of the reference quantizer (per-token groups of 32, 32x32 blocks)
    q_ref, s_ref = ref_quantize(fc1.weight.detach(), 32, 32)
    w_ref = (q_ref * s_ref.repeat_interleave(32, 0).repeat_interleave(32, 1)).float()
    x = seen["x"].to(torch.bfloat16).float()
    xg = x.reshape(-1, 4, 32)
    xs = (xg.abs().amax(-1, keepdim=True) / 448).clamp_min(0)
    xs = torch.where(xs == 0, torch.ones_like(xs), xs)
    xq = ((xg / xs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs).reshape(x.shape)
    expect = (xq @ w_ref.t()).to(torch.bfloat16)
    assert seen["y"].dtype == torch.bfloat16 and torch.equal(seen["y"], expect)
    assert torch.equal(weights["decoder.layers.1.self_attention.linear_qkv"].q.view(torch.uint8), fp8.quantize_weight(
        gpt.decoder.layers[1].self_attention.linear_qkv.weight, (32, 32))[0].view(torch.uint8))
    gap_fp8, gap_bf16 = (quantized.float() - plain).abs().mean(), (bf16.float() - plain).abs().mean()
    assert gap_fp8 > 2 * gap_bf16 > 0
    # fp32 weights: the shadow's forward dequantizes each linear when it runs (never all at once); the megatron
    # generator's decode loop holds them from entry; both compute the same bits
    dequantized, dequantize = [], fp8.dequantize_weight
    monkeypatch.setattr(fp8, "dequantize_weight", lambda q, s: dequantized.append(q.shape) or dequantize(q, s))
    for hold, at_entry, per_forward in ((False, 0, len(names)), (True, len(names), 0)):
        dequantized.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fp8.fp8_forward(gpt, recipe, weights, hold):
            assert len(dequantized) == at_entry
            assert torch.equal(forward_logits(model, ids), quantized)
            assert len(dequantized) == at_entry + per_forward


# ---- the fp8 precision in the forwards (models/forward.py) ------------------------------------------------------

RECIPE = fp8.Fp8Recipe(weight_block_size=(32, 32), activation_block_size=32)
"""The tiny models' blocks (hidden 128, head_dim 32, ffn 384)."""


def fp8_reference_log_probs(model, input_ids, labels, recipe=RECIPE, temperature=1.0):
    """fp32 log-probs of ``labels`` from one forward under bf16 autocast with the FP8 linears
    (``fp8.fp8_forward``, checked above against the reference quantizer): what the fp8 precision means."""
    from megatron_grpo.models import forward_logits, unwrap

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fp8.fp8_forward(unwrap(model), recipe):
        logits = forward_logits(model, input_ids)
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def fp8_model(tiny_dense, megatron_single):
    from megatron_grpo.models import build_from_hf

    return build_from_hf(tiny_dense, fp8_recipe=RECIPE)[0]


def test_forward_log_probs_in_fp8_quantize_once_with_the_models_recipe(fp8_model, tiny_dense, monkeypatch):
    from megatron_grpo.models import build_from_hf, unwrap
    from megatron_grpo.models.forward import fp8_context, forward_log_probs, pack

    calls = []
    quantize = fp8.quantize_model
    monkeypatch.setattr(fp8, "quantize_model", lambda *a: calls.append(1) or quantize(*a))
    g = torch.Generator().manual_seed(5)
    packed = pack([torch.randint(3, 1000, (20 - i,), generator=g).tolist() for i in range(6)], [4] * 6)
    lp = {dtype: forward_log_probs(fp8_model, packed, compute_dtype=dtype, params_dtype=torch.float32,
                                   temperature=0.7, micro_batch_size=2)
          for dtype in (torch.float8_e4m3fn, torch.bfloat16)}
    assert len(calls) == 1  # one quantization for the pass's three micro-batches
    ref = fp8_reference_log_probs(fp8_model, packed.input_ids, packed.labels, temperature=0.7)  # quantizes too
    m = packed.mask
    torch.testing.assert_close(lp[torch.float8_e4m3fn][m], ref[m], atol=1e-5, rtol=0)
    assert (lp[torch.bfloat16] - ref)[m].abs().mean() > 1e-3  # fp8 is not bf16: the FP8 linears did run
    # nested contexts share the outer one's bytes (the megatron generator: decode + scoring on one quantization)
    with fp8_context(fp8_model, torch.float8_e4m3fn) as outer:
        again = forward_log_probs(fp8_model, packed, compute_dtype=torch.float8_e4m3fn, params_dtype=torch.float32,
                                  temperature=0.7, micro_batch_size=2)
        with fp8_context(fp8_model, torch.float8_e4m3fn) as inner:
            assert inner is outer
    assert len(calls) == 3 and torch.equal(again, lp[torch.float8_e4m3fn])
    assert getattr(unwrap(fp8_model), "fp8_weights_in_use") is None
    bare = build_from_hf(tiny_dense, load_weights=False)[0]
    with pytest.raises(ValueError, match="without FP8 settings"):
        forward_log_probs(bare, packed, compute_dtype=torch.float8_e4m3fn, params_dtype=torch.float32)


def test_fp8_precision_runs_bf16_around_its_linears():
    from megatron_grpo.models.forward import around_dtype, precision_context

    assert around_dtype(torch.float8_e4m3fn) == torch.bfloat16 and around_dtype(torch.float16) == torch.float16
    with precision_context(torch.float8_e4m3fn, torch.float32):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with precision_context(torch.float8_e4m3fn, torch.bfloat16):  # bf16 params: bf16 already
        assert not torch.is_autocast_enabled("cpu")
