"""Decode and prefill benchmark: the full-size Flint with random weights built on the GPU (no checkpoint or disk).

python bench.py                      # BF16 and NVFP4: decode at batch 1/8/64, context 512 and 32K; prefill of
                                     # 512, 8K, 32K and 128K-token prompts; fast vs reference path

Decode: measures the two bandwidth floors first (device copy, large GEMV read), then per configuration the median
time of a decode step, from runs of CHAIN CUDA-graph replays queued as generate.py queues them (fast path) or from
eager steps (plain-torch reference path), and reports tok/s, ms per step, the bytes a step must read (active
weights + KV cache), achieved GB/s and its share of the measured floor. Prefill: time to first token of one prompt
(chunked prefill + sampling the first token; the fast path after a warm-up that compiles its kernels), prompt
tok/s, and peak GPU memory. --breakdown: where the fast decode step's time goes, op by op (see breakdown). Prints
markdown tables last.

python bench.py --weights bf16 --paths fast --batch 1 --context 512 --prefill --breakdown   # one breakdown
"""
import argparse
import datetime
import statistics
import sys
import time

import torch

import flint
import load
from generate import PREFILL_CHUNK, HelpFormatter, decode, prefill

def floors(dev):
    """GB/s of a device-to-device copy (read + write) and of a bf16 GEMV that reads an lm_head-sized weight."""
    from triton.testing import do_bench
    a = torch.empty(2**30, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), return_mode="median")
    copy = 2 * a.numel() / t / 1e6
    del a, b
    w = torch.randn(150144, 2048, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    t = do_bench(lambda: torch.mm(x, w.t()), return_mode="median")
    return copy, w.numel() * 2 / t / 1e6


def step_bytes(cfg, B, ctx, nvfp4):
    """Bytes one decode step must read: weights of the experts B tokens touch (expected unique experts under
    uniform routing) and everything else once, plus the KV cache at context ctx."""
    C, D, H, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    E, A, I, S = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    per = 0.5625 if nvfp4 else 2.0                                      # NVFP4: 4 bits + one e4m3 scale per 16
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    n_dense = cfg.num_hidden_layers - n_moe
    experts = E * (1 - (1 - A / E) ** B)
    linear = (cfg.num_hidden_layers * ((H + 2 * G) * D * C + C * H * D) + n_dense * 3 * C * cfg.intermediate_size
              + n_moe * (experts * 3 * C * I + 3 * C * S) + cfg.vocab_size * C)
    router = n_moe * E * C * 2
    n_full = sum(not cfg.is_sliding(i) for i in range(cfg.num_hidden_layers))
    kv = B * 2 * G * D * 2 * (n_full * ctx + (cfg.num_hidden_layers - n_full) * min(ctx, cfg.sliding_window))
    return linear * per + router + kv


def timed(fn, dev, iters, graph=False):
    """Median seconds of fn() after a warm-up call (which compiles the kernels): eager calls, or replays of one
    CUDA graph of fn (graph=True)."""
    fn()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):                                 # warm-up on a side stream, as torch asks
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


# decode steps per timed run, as generate.decode runs them. Each run starts and ends with the host waiting (as a reply
# does): H100, NVFP4 batch 1 at 4K, 2026-12-07 (.dev/bnd2.py, us per step) 1407.9 in runs of 16, 1402.9 of 128
CHAIN = 64


def time_steps(step, B, ctx, dev, iters, chain=CHAIN):
    """Median seconds of one decode step at position ctx, from runs of `chain` steps as generate.decode runs them
    (each step going on from the one before, its ids copied to the host beside the step after it); the cache holds
    ctx + chain slots."""
    ids = torch.randint(0, step.model.cfg.vocab_size, (B,), device=dev)
    pos = torch.full((B,), ctx, device=dev)

    def run():
        for _ in decode(step, ids, pos, chain + 1):                     # (the first yield is ids itself)
            pass
    return timed(run, dev, iters) / chain


def random_cache(cfg, B, ctx, dev):
    cache = flint.KVCache(cfg, B, ctx + CHAIN, torch.bfloat16, dev)
    for k, v in zip(cache.k, cache.v):                                  # random contents, as a real cache has
        k.normal_()
        v.normal_()
    return cache


def breakdown(model, B, ctx, iters=20):
    """Where the decode step's time goes: each op of the step (model.decode_ops) timed alone over every layer that
    has it, so that its weights come from HBM as in a step, not from L2; per layer and per step, as rows. On CUDA
    the ops and the step are CUDA-graph replays; "between ops" is the step minus the ops: launch gaps, the
    embedding gather and sampling."""
    cfg, dev, ops, eps = model.cfg, model.device, model.decode_ops, model.cfg.rms_norm_eps
    C, H, G, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cache = random_cache(cfg, B, ctx, dev)
    cos, sin = flint.rope_table(cfg, ctx + 8, dev)
    pos = torch.full((B,), ctx, device=dev)
    x = torch.randn(B, C, device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(B, (H + 2 * G) * D, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(B, cfg.num_experts, device=dev, dtype=torch.bfloat16)
    blocks = list(model.layers)
    moe = [b for b in blocks if isinstance(b.ffn, flint.MoE)]

    def attention(b):
        a = b.attn
        return ops.attention_decode(qkv, a.q_norm, a.k_norm, a.sinks, cos, sin, cache.k[a.layer], cache.v[a.layer],
                                    pos, a.window, eps, a.o)

    parts = [  # (op, the layers that have it, one call)
        ("qkv: add + norm + GEMV", blocks, lambda b: ops.add_norm_linear(x, x, b.attn_norm, b.attn.qkv, eps)),
        ("attention + o_proj, sliding", [b for b in blocks if b.attn.window], attention),
        ("attention + o_proj, full", [b for b in blocks if not b.attn.window], attention),
        ("dense MLP", [b for b in blocks if b not in moe],
         lambda b: ops.linear(ops.add_norm_swiglu(x, x, b.ffn_norm, b.ffn.gate_up, eps)[1], b.ffn.down)),
        ("router: add + norm + GEMV", moe, lambda b: ops.add_norm_linear(x, x, b.ffn_norm, b.ffn.router, eps)),
        ("experts", moe, lambda b: ops.moe_experts(x, logits, b.ffn.gate_up, b.ffn.down, b.ffn.shared_gate_up,
                                                    b.ffn.shared_down, b.ffn.top_k, b.ffn.norm_topk_prob)),
        ("lm_head", [model], lambda m: ops.add_norm_linear(x, x, m.norm, m.lm_head, eps, f32=True)),
    ]
    graph = dev.type == "cuda"
    rows, total = [], 0.0
    for name, where, op in parts:
        if where:
            t = timed(lambda: [op(b) for b in where], dev, iters, graph)
            rows.append(dict(op=name, layers=len(where), us_layer=t / len(where) * 1e6, us_step=t * 1e6))
            total += t
    step = flint.DecodeStep(model, cache, 0.0, 0, 1.0, graph=graph)
    t = time_steps(step, B, ctx, dev, iters)
    rows.append(dict(op="between ops", layers=len(blocks), us_layer=(t - total) / len(blocks) * 1e6,
                     us_step=(t - total) * 1e6))
    for r in rows:
        r["share"] = r["us_step"] / (t * 1e6) * 100
    return rows, t


def log(row, prefix=""):
    """One measurement as key=value pairs on stderr, as it is taken (the tables come last, on stdout)."""
    print("  " + prefix + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          file=sys.stderr)


def bench_config(model, cfg, weights, B, ctx, args, gemv_bw):
    dev = model.device
    cache = random_cache(cfg, B, ctx, dev)
    nbytes = step_bytes(cfg, B, ctx, weights == "nvfp4")
    rows = []
    for path in args.paths:
        model.decode_ops = flint.kernel_ops() if path == "fast" else flint.REFERENCE_OPS
        step = flint.DecodeStep(model, cache, 0.0, 0, 1.0, graph=path == "fast")
        fast = path == "fast"                                           # (eager reference steps take ~0.2 s)
        t = time_steps(step, B, ctx, dev, args.iters if fast else 3, CHAIN if fast else 1)
        del step
        row = dict(weights=weights, path=path, batch=B, context=ctx, tok_s=B / t, ms=t * 1e3,
                   gb=nbytes / 1e9, gbs=nbytes / t / 1e9, floor=nbytes / t / 1e9 / gemv_bw * 100)
        log(row)
        rows.append(row)
    return rows


def bench_prefill(model, cfg, weights, n, args):
    """Time to first token of an n-token prompt on each path (the reference only up to --reference-max tokens)."""
    dev = model.device
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    rows = []
    for path in args.paths:
        if path == "reference" and n > args.reference_max:
            print(f"  {weights} prefill {n} reference: skipped (over --reference-max {args.reference_max})",
                  file=sys.stderr)
            continue
        model.prefill_ops = flint.prefill_ops() if path == "fast" else flint.REFERENCE_OPS
        cache = flint.KVCache(cfg, 1, n, torch.bfloat16, dev)
        if path == "fast":                                              # compile: a whole chunk and the last one
            for m in {min(n, args.chunk), n % args.chunk}:
                if m:
                    prefill(model, cache, ids[:m], chunk_size=args.chunk)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        logits = prefill(model, cache, ids, chunk_size=args.chunk)
        int(logits.argmax())                                            # the first token, on the host
        t = time.perf_counter() - t
        row = dict(weights=weights, path=path, prompt=n, ttft=t, tok_s=n / t,
                   peak=torch.cuda.max_memory_allocated() / 2**30)
        log(row, "prefill ")
        rows.append(row)
        del cache, logits
        torch.cuda.empty_cache()
    return rows


def main(args):
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU: it builds the full-size model on the GPU, and this torch sees "
                         "none (torch.cuda.is_available() is False)")
    dev = torch.device("cuda")
    copy_bw, gemv_bw = floors(dev)
    print(f"floors: device copy {copy_bw:.0f} GB/s, bf16 GEMV read {gemv_bw:.0f} GB/s", file=sys.stderr)
    cfg = flint.Config(rope_theta=10000.0)
    rows, prefill_rows, breakdowns = [], [], []
    for weights in args.weights:
        nvfp4 = weights == "nvfp4"
        names = [n for n, _ in flint.Transformer(cfg, torch.bfloat16, "meta").weights()
                 if n.endswith(load.NVFP4_WEIGHTS)]
        model = flint.init_random(flint.Transformer(cfg, torch.bfloat16, dev, nvfp4=names if nvfp4 else ()))
        print(f"{weights}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB of weights", file=sys.stderr)
        for ctx in args.context:
            for B in args.batch:
                try:
                    rows += bench_config(model, cfg, weights, B, ctx, args, gemv_bw)
                except torch.OutOfMemoryError:
                    print(f"{weights} batch {B} context {ctx}: out of memory", file=sys.stderr)
                torch.cuda.empty_cache()
                if args.breakdown:
                    model.decode_ops = flint.kernel_ops()
                    parts, t = breakdown(model, B, ctx, args.iters)
                    for r in parts:
                        log(dict(weights=weights, batch=B, context=ctx, **r), "breakdown ")
                    breakdowns.append((weights, B, ctx, t, parts))
        for n in args.prefill:
            try:
                prefill_rows += bench_prefill(model, cfg, weights, n, args)
            except torch.OutOfMemoryError:
                print(f"{weights} prefill {n}: out of memory", file=sys.stderr)
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}; floors: copy "
          f"{copy_bw:.0f} GB/s, GEMV read {gemv_bw:.0f} GB/s; `python bench.py {' '.join(sys.argv[1:])}`\n")
    print("| weights | path | batch | context | tok/s | ms/step | GB/step | GB/s | % of floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['path']} | {r['batch']} | {r['context']} | {r['tok_s']:.1f} | {r['ms']:.2f} | "
              f"{r['gb']:.2f} | {r['gbs']:.0f} | {r['floor']:.0f}% |")
    for weights, B, ctx, t, parts in breakdowns:
        print(f"\nDecode step, fast path, {weights}, batch {B}, context {ctx}: {t * 1e3:.3f} ms; each op timed alone "
              f"over the layers that have it:\n")
        print("| op | layers | us per layer | us per step | share of the step |")
        print("|---|---|---|---|---|")
        for r in parts:
            print(f"| {r['op']} | {r['layers']} | {r['us_layer']:.1f} | {r['us_step']:.0f} | {r['share']:.0f}% |")
    if prefill_rows:
        print(f"\nPrefill, one prompt, chunks of {args.chunk} tokens:\n")
        print("| weights | path | prompt tokens | time to first token (s) | prompt tok/s | peak GPU memory (GiB) |")
        print("|---|---|---|---|---|---|")
        for r in prefill_rows:
            print(f"| {r['weights']} | {r['path']} | {r['prompt']} | {r['ttft']:.3f} | {r['tok_s']:.0f} | "
                  f"{r['peak']:.1f} |")


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--weights", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"],
                   help="weight formats of the random full-size model")
    p.add_argument("--batch", nargs="*", type=int, default=[1, 8, 64], help="decode batch sizes (none: skip decode)")
    p.add_argument("--context", nargs="+", type=int, default=[512, 32768], help="cached tokens before each step")
    p.add_argument("--paths", nargs="+", default=["fast", "reference"], choices=["fast", "reference"],
                   help="the Triton kernels in CUDA graphs, and the plain-torch reference ops")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each op of the fast decode step alone, per batch and context")
    p.add_argument("--iters", type=int, default=15, help=f"timed runs (of {CHAIN} graph replays) per configuration")
    p.add_argument("--prefill", nargs="*", type=int, default=[512, 8192, 32768, 131072],
                   help="prompt lengths for the prefill benchmark (none: skip it)")
    p.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help="prefill chunk size")
    p.add_argument("--reference-max", type=int, default=131072,
                   help="longest prompt to prefill on the reference path (1,400 to 500 tok/s: 4 to 5 minutes per "
                        "weight format at 128K)")
    return p


if __name__ == "__main__":
    p = parser()
    args = p.parse_args()
    if not all(1 <= B <= flint.MAX_DECODE_BATCH for B in args.batch):
        p.error(f"--batch {args.batch}: each batch must be 1 to {flint.MAX_DECODE_BATCH}")
    if min(args.context + args.prefill + [args.iters, args.chunk]) < 1:
        p.error("--context, --prefill, --iters and --chunk take positive numbers")
    main(args)
