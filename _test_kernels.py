import os

import torch

if not torch.cuda.is_available():                                       # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import flint
import kernels

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def close(got, want):
    """bf16 tolerances: the kernels sum in another order, so an intermediate rounded to bf16 (h, q, k, g, u, P)
    may land one ulp (2^-8 relative) away, and that moves the outputs by about as much."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape and torch.isfinite(got).all()
    err, scale = (got - want).abs(), want.abs().max().item() + 1e-6
    assert err.max() <= 0.04 * scale and err.mean() <= 0.004 * scale, \
        f"max error {err.max().item():.3g}, mean {err.mean().item():.3g}, max |want| {scale:.3g}"


def rand_weight(*shape, nvfp4=False, std=0.05, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if nvfp4:
        *lead, N, K = shape
        packed = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8)
        scales = (torch.rand(*lead, N, K // 16, generator=g) * 0.5 * std + 0.1 * std).to(torch.float8_e4m3fn)
        row_scale = torch.rand(*lead, N, generator=g) + 0.5
        return flint.NVFP4(packed.to(DEV), scales.to(DEV), row_scale.to(DEV))
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).to(DEV)


def rand_act(*shape, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("B", [1, 3, 17])
@pytest.mark.parametrize("nvfp4", [False, True])
def test_add_norm_linear_kernel(B, nvfp4):
    K, N = 64, 40
    x, dx, nw = rand_act(B, K, seed=1), rand_act(B, K, seed=2), rand_act(K, seed=3)
    w = rand_weight(N, K, nvfp4=nvfp4)
    for args in [(x, dx, nw, w, 1e-6), (x, None, nw, w, 1e-6)]:
        for f32 in (False, True):
            got, want = kernels.add_norm_linear(*args, f32=f32), flint.add_norm_linear_ref(*args, f32=f32)
            for g, r in zip(got, want):
                close(g, r)
    close(kernels.linear(x, w), flint.linear_ref(x, w))
    swiglu_w = rand_weight(2 * N, K, nvfp4=nvfp4, seed=4)
    for g, r in zip(kernels.add_norm_swiglu(x, dx, nw, swiglu_w, 1e-6),
                    flint.add_norm_swiglu_ref(x, dx, nw, swiglu_w, 1e-6)):
        close(g, r)


@pytest.mark.parametrize("window, S, H, G", [(5, 5, 4, 2), (0, 40, 8, 2), (7, 7, 8, 8)])
def test_attention_decode_kernel(window, S, H, G):
    """Positions before, at and past the ring's wrap, two rows at different positions, GQA groups 1..4."""
    B, D = 2, 32
    cfg = flint.Config(rope_theta=10000.0, head_dim=D)
    cos, sin = flint.rope_table(cfg, 64, DEV)
    q_norm, k_norm = rand_act(D, seed=5).float().abs().to(torch.bfloat16), rand_act(D, seed=6)
    sinks = torch.randn(H, device=DEV)
    for step, pos in enumerate([[0, 3], [4, 5], [6, 12], [S - 1, 2 * S + 3]]):
        pos = torch.tensor(pos, device=DEV) if window else torch.tensor(pos, device=DEV).clamp(max=S - 1)
        qkv = rand_act(B, (H + 2 * G) * D, seed=10 + step)
        kc, vc = rand_act(B, S, G, D, seed=20 + step), rand_act(B, S, G, D, seed=30 + step)
        kc2, vc2 = kc.clone(), vc.clone()
        got = kernels.attention_decode(qkv, q_norm, k_norm, sinks, cos, sin, kc, vc, pos, window, 1e-6)
        want = flint.attention_decode_ref(qkv, q_norm, k_norm, sinks, cos, sin, kc2, vc2, pos, window, 1e-6)
        close(got, want)
        close(kc, kc2)
        assert torch.equal(vc, vc2)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("nvfp4", [False, True])
def test_moe_experts_kernel(B, nvfp4):
    E, A, C, I, S = 8, 3, 64, 32, 64
    h = rand_act(B, C, seed=7)
    logits = rand_act(B, E, seed=8)
    logits[0, [2, 5, 6]] = logits[0].max() + 1                          # a three-way tie: lowest index first
    gate_up, down = rand_weight(E, 2 * I, C, nvfp4=nvfp4, seed=1), rand_weight(E, C, I, nvfp4=nvfp4, seed=2)
    sgate_up, sdown = rand_weight(2 * S, C, nvfp4=nvfp4, seed=3), rand_weight(C, S, nvfp4=nvfp4, seed=4)
    got = kernels.moe_experts(h, logits, gate_up, down, sgate_up, sdown, A, True)
    want = flint.moe_experts_ref(h, logits, gate_up, down, sgate_up, sdown, A, True)
    close(got, want)


def tiny_model(nvfp4=False, seed=0):
    cfg = flint.Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, sliding_window=5,
                       rope_theta=10000.0)
    names = [n for n, _ in flint.Transformer(cfg, torch.bfloat16, "meta").weights()
             if n.endswith(("qkv", ".o", "gate_up", "down", "lm_head"))] if nvfp4 else ()
    model = flint.init_random(flint.Transformer(cfg, torch.bfloat16, DEV, nvfp4=names), seed=seed, std=0.1)
    model.decode_ops = flint.REFERENCE_OPS
    return model


@pytest.mark.parametrize("nvfp4", [False, True])
def test_decode_kernels_match_reference_path(nvfp4):
    """Whole decode steps of a tiny bf16 model: Triton ops against reference ops, across the ring's wrap."""
    model = tiny_model(nvfp4)
    B, T = 2, 9
    ids = torch.randint(0, 300, (B, T + 4), device=DEV)
    caches = [flint.KVCache(model.cfg, B, 32, torch.bfloat16, DEV) for _ in range(2)]
    logits = []
    for cache, ops in zip(caches, [flint.REFERENCE_OPS, flint.kernel_ops()]):
        model.decode_ops = ops
        model(ids[:, :T], torch.arange(T, device=DEV)[None].expand(B, T), cache)
        logits.append(torch.cat([model(ids[:, t:t + 1], torch.full((B, 1), t, device=DEV), cache)
                                 for t in range(T, T + 4)], 1))
    close(logits[1], logits[0])
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean() >= 0.9


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("nvfp4", [False, True])
def test_gpu_graph_generation_matches_reference(nvfp4):
    """Greedy: 64 tokens from CUDA-graph replays of the Triton path equal the eager reference path's."""
    from generate import generate
    model = tiny_model(nvfp4, seed=1)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    out = []
    for ops, graph in [(flint.REFERENCE_OPS, False), (flint.kernel_ops(), True), (flint.kernel_ops(), False)]:
        model.decode_ops = ops
        cache = flint.KVCache(model.cfg, 2, 80, torch.bfloat16, DEV)
        out.append(torch.stack([t.clone() for t in generate(model, cache, prompts, 64, 0.0, 0, 1.0, graph=graph)]))
    assert torch.equal(out[1], out[2]), "graph replay differs from eager"
    assert torch.equal(out[1], out[0]), f"fast path differs from the reference: {(out[1] != out[0]).sum()} tokens"


@cuda
@pytest.mark.parametrize("nvfp4", [False, True])
def test_gpu_full_size_teacher_forced(nvfp4):
    """Full-size random Flint: 32 teacher-forced decode steps after a 600-token prompt (the ring has wrapped),
    Triton path against the reference path: logits within bf16 tolerance, top-1 agreement >= 99%."""
    cfg = flint.Config(rope_theta=10000.0)
    kinds = ("qkv", ".o", "gate_up", "down", "lm_head")
    names = [n for n, _ in flint.Transformer(cfg, torch.bfloat16, "meta").weights() if n.endswith(kinds)]
    model = flint.init_random(flint.Transformer(cfg, torch.bfloat16, DEV, nvfp4=names if nvfp4 else ()), std=0.05)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 632), generator=g).to(DEV)
    out = []
    for ops in [flint.REFERENCE_OPS, flint.kernel_ops()]:
        model.decode_ops = ops
        cache = flint.KVCache(cfg, 1, 640, torch.bfloat16, DEV)
        model(ids[:, :600], torch.arange(600, device=DEV)[None], cache)
        out.append(torch.cat([model(ids[:, t:t + 1], torch.tensor([[t]], device=DEV), cache)[0]
                              for t in range(600, 632)]))
    del model
    torch.cuda.empty_cache()
    ref, fast = out
    diff = (fast - ref).abs()
    agree = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\nfull-size {'nvfp4' if nvfp4 else 'bf16'}: max |diff| {diff.max().item():.4f}, mean {diff.mean().item():.5f}, "
          f"max |logit| {ref.abs().max().item():.3f}, top-1 agreement {agree:.3f}")
    assert agree >= 0.99
    assert diff.mean() <= 0.02 * ref.abs().mean()
