"""Triton kernels for Flint: each has a plain-torch twin of the same name plus `_ref` in flint.py.

- add_norm_linear: residual add + RMSNorm + GEMV (qkv, router, lm_head), optionally + SwiGLU (dense MLP gate/up).
- linear: GEMV (o_proj, dense down).
- attention_decode: q/k RMSNorm + RoPE + KV-cache write + attention with learned sinks, split over the keys
  (flash-decoding, Dao et al. 2023) so that one sequence fills the GPU, then the splits' combine kernel and the
  o_proj GEMV.
- moe_experts: sigmoid top-k routing + gate/up + SwiGLU of the selected experts and the shared expert in one
  launch, then down + weighted combine + shared add in one launch.
- greedy_next: the argmax of the logits, written with the positions + 1 as the next decode step's input.
Prompt chunks (flint.prefill_ops):
- sink_attention: flash attention with sinks over keys named by their positions, causal and sliding-window.
- experts: the routed experts of many tokens as grouped GEMMs over tokens sorted by expert.
- matmul: GEMM for NVFP4 weights (bf16 ones go to cuBLAS).
- add_rms_norm, qk_norm_rope, route: the norms (and RoPE) and the routing of the chunk's rows, one pass each.

On SM90 and newer, decode kernels take programmatic dependent launch (PDL, `_pdl_wait`): each may start while the
kernel before it still runs, load its weights, then wait for that kernel to finish.

Weights are bf16 [N, K] or NVFP4 (flint.NVFP4: nibble plane [N, K/2], e4m3 scales [N, K/16], fp32 row scale),
dequantized in registers (no FP4 tensor cores on SM90). Every product is exact in fp32 and sums accumulate in fp32,
like the references; kernels differ from them only in summation order (and, in attention, in the running max that
P is rounded against). Kernels also run under TRITON_INTERPRET=1 (CPU CI): there bf16 is emulated, so tensors are
cast to fp32 right after loading and tl.dot runs in fp32.
"""
import functools
import os

# The kernels are written for fused multiply-adds (their FMA chains; the H200 timings in the comments): ask for them,
# as triton 3.10 stops fusing by default
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"   # set by the caller before importing triton
IN_INTERPRETER = tl.constexpr(INTERPRET)                # INTERPRET in kernels: tl.dot on fp32, no PTX
LOG2E = 1.4426950408889634                              # 1 / ln 2: softmax runs on exp2


@functools.cache
def _pdl_device(index):
    """Whether CUDA device `index` has programmatic dependent launch (SM90 and newer)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


# Programmatic dependent launch of the decode kernels (_pdl_wait). Whole CUDA-graph steps on an H200, 2026-12-04, two
# alternated rounds (.dev/pdl_ab.py, tok/s without -> with): bf16 batch 1 at 512 430.1 / 440.1 -> 451.1 / 463.6, at 32K
# 389.9 / 391.0 -> 401.3 / 402.3, batch 8 1029.3 / 1044.2 -> 1031.1 / 1036.9. NVFP4 then measured slower (batch 1 at
# 512 557.9 / 580.7 -> 533.6 / 532.8) with its weights loaded after the wait and the splits' combine inside o_proj;
# with both changed it gains: H100, 2026-12-06, whole NVFP4 steps (.dev/ab.py, two or three alternated rounds, tok/s,
# with the tiles and the shared expert first as now against without PDL as before) batch 1 at 512 / 4K / 32K
# 562.6-562.7 / 547.1-550.1 / 469.7-469.8 -> 652.2-652.8 / 624.8-625.9 / 528.6-530.1, batch 2 / 4 / 8 at 4K
# 669.9-707.6 / 929.5-960.7 / 1090.5-1121.4 -> 706.3-706.5 / 994.7-994.8 / 1101.5-1109.5. The first K step's NVFP4
# codes decoded before the wait too (2026-12-06, .dev/ab.py, two or three alternated rounds, tok/s): H200, batch 1 at
# 4K 636.1-639.8 -> 644.3-649.3; H100, batch 1 at 512 / 32K 646.1-660.6 / 530.7 -> 663.3-664.0 / 531.6-532.2, batch 2
# / 8 at 4K 708.3-710.7 / 1102.0-1105.4 -> 734.3 / 1108.5-1109.0.
# One row lets the next kernel launch before the wait (PDL 2): H100, 2026-12-05, bf16 whole steps, two alternated
# rounds (.dev/pdl_ab.py, tok/s after -> before the wait): batch 1 at 512 388.3 / 384.9 -> 398.5 / 394.0, at 32K
# 334.8 / 338.8 -> 349.7 / 349.6; batch 2 560.4 / 562.3 -> 559.1 / 560.4, batch 8 885.2 / 888.1 -> 851.4 / 850.5
def _pdl_on(t):
    """Whether the decode kernels reading tensor t take programmatic dependent launch: on SM90 and newer GPUs."""
    return not INTERPRET and t.is_cuda and _pdl_device(t.device.index)


def _pdl(t):
    """_pdl_wait's PDL for the decode kernels reading the rows of t: one row launches the next kernel before its
    wait (2), more rows after it (1); 0 without PDL (_pdl_on)."""
    return (2 if t.shape[0] == 1 else 1) if _pdl_on(t) else 0


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Programmatic dependent launch (PDL 1 or 2): a kernel launched with it may start while the kernel before it
    still runs, so its programs first load what no kernel of the step writes (weights, earlier steps' cache slots),
    then wait here until that kernel has finished and its writes are visible, before reading any activation and
    before writing anything. They let the next kernel launch after the wait (1: at most two kernels run at once, and
    all before the one running have finished) or just before it (2: the next may then load its weights while this
    one waits too; its own wait still orders it after this kernel, which finishes after the one before)."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


# -----------------------------------------------------------------------------
# Shared pieces: input rows, weight tiles, multiply-accumulate


@triton.jit
def _round_bf16(x):
    """Round fp32 to the nearest bf16 (ties to even), kept in fp32: where the reference stores an intermediate in
    the model dtype. Integer ops, because the interpreter's fp32 -> bf16 cast truncates."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(x):
    return _round_bf16(x).to(tl.bfloat16)                             # exact: the value is a bf16 already


@triton.jit
def _load_f32(ptr, mask):
    # the interpreter refuses `other=` on bf16 loads: mask afterwards
    return tl.where(mask, tl.load(ptr, mask=mask).to(tl.float32), 0.0)


@triton.jit
def _e2m1(code):
    """E2M1 code (uint8, 4 bits) -> value / 2^14 as fp32: the 3 magnitude bits go to fp16 bits 9-11, the sign to
    bit 15, and the bitcast gives 0, 0.5, 1, ..., 6 times 2^-14 (fp16 subnormals for 0 and 0.5)."""
    c = code.to(tl.uint16)
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)


# Eight E2M1 codes at once (inline PTX; SM90 has no FP4 conversion): register $4 holds 4 bytes of the nibble plane,
# byte i the codes of elements 2i (low nibble) and 2i + 1 (high). Bytes 1 and 2 swap places (prmt), so that codes
# 16 bits apart are those of bytes (0, 1) and (2, 3); the same shift and masks as _e2m1 then land two codes in the
# two fp16 halves of one register, four shifts for all eight. Outputs, two fp16 each, in element order: low nibbles
# of bytes 0-1 ($0) and 2-3 ($1), high nibbles of bytes 0-1 ($2) and 2-3 ($3). The values stay fp16 until they
# are used, so kernels that move them between threads move half the bytes of fp32.
_E2M1_BYTES_ASM = tl.constexpr("""{
.reg .b32 r, a, b;
prmt.b32 r, $4, 0, 0x3120;
shl.b32 a, r, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, r, 12; and.b32 b, b, 0x80008000; or.b32 $0, a, b;
shl.b32 a, r, 1; and.b32 a, a, 0x0E000E00; shl.b32 b, r, 4; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
shl.b32 a, r, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, r, 8; and.b32 b, b, 0x80008000; or.b32 $2, a, b;
shr.b32 a, r, 3; and.b32 a, a, 0x0E000E00; and.b32 b, r, 0x80008000; or.b32 $3, a, b;
}""")


@triton.jit
def _e2m1_pair(byte):
    """Bytes of two E2M1 codes -> (low code, high code) as _e2m1 gives them, fp32. On the GPU 4 bytes per block of
    inline PTX: about 1.7 instructions per code where unpacking byte by byte takes about 7 (sm_90 code of the NVFP4
    decode MoE gate/up kernel at a (4, 1024, 4) tile: 1392 instructions against 1936); byte by byte under the
    interpreter (no PTX)."""
    if IN_INTERPRETER:
        return _e2m1(byte & 15), _e2m1(byte >> 4)
    lo, hi = tl.inline_asm_elementwise(_E2M1_BYTES_ASM, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                       is_pure=True, pack=4)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _below(a, n, EVEN: tl.constexpr):
    """a < n, or all true when EVEN says so of the shapes: a constant mask, which the compiler drops from loads."""
    if EVEN:
        return tl.full(a.shape, 1, tl.int1)
    return a < n


@triton.jit
def _input_rows(x_ptr, dx_ptr, nw_ptr, rstd, offs_b, offs_k, B, K, stride_b,
                ADD: tl.constexpr, NORM: tl.constexpr, EVEN: tl.constexpr):
    """Input tile [BLOCK_B, len(offs_k)] fp32: x (+ dx), RMS-normalized by rstd and nw and rounded like h.
    EVEN: the columns are all < K (no per-element mask)."""
    kmask = _below(offs_k, K, EVEN)
    mask = (offs_b[:, None] < B) & kmask[None, :]
    off = offs_b[:, None] * stride_b + offs_k[None, :]
    x = _load_f32(x_ptr + off, mask)
    if ADD:
        x += _load_f32(dx_ptr + off, mask)
    if NORM:
        nw = _load_f32(nw_ptr + offs_k, kmask)
        x = _round_bf16(x * rstd[:, None] * nw[None, :])
    return x


@triton.jit
def _dot(acc, x, w):
    """acc[b, n] += sum_k x[b, k] * w[n, k] on tensor cores (bf16 operands: the values are bf16-exact), fp32
    accumulation."""
    if IN_INTERPRETER:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))


@triton.jit
def _input_row(x_ptr, dx_ptr, nw_ptr, rstd, b, offs_k, B, K, stride_b,
               ADD: tl.constexpr, NORM: tl.constexpr, EVEN: tl.constexpr):
    """Row b of the input at columns offs_k (any shape) fp32: x (+ dx), RMS-normalized by rstd and nw, rounded."""
    mask = _below(offs_k, tl.where(b < B, K, 0), EVEN)                # rows past B read as 0
    x = _load_f32(x_ptr + b * stride_b + offs_k, mask)
    if ADD:
        x += _load_f32(dx_ptr + b * stride_b + offs_k, mask)
    if NORM:
        x = _normed_row(x, nw_ptr, rstd, offs_k, K, EVEN)
    return x


@triton.jit
def _normed_row(x, nw_ptr, rstd, offs_k, K, EVEN: tl.constexpr):
    """x (+ dx) at columns offs_k, RMS-normalized by rstd and nw and rounded like h."""
    return _round_bf16(x * rstd * _load_f32(nw_ptr + offs_k, _below(offs_k, K, EVEN)))


@triton.jit
def _pair_words(ptr, j, mask=None):
    """bf16 elements 2j and 2j + 1 at ptr as one int32 each (any shape of j); masked pairs read as 0."""
    ptr = ptr.to(tl.pointer_type(tl.int32)) + j
    return tl.load(ptr) if mask is None else tl.load(ptr, mask=mask, other=0)


@triton.jit
def _halves(pair):
    """int32 pairs of bf16 (_pair_words) -> (even, odd) fp32."""
    return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pairs(ptr, j, mask=None):
    """_pair_words as fp32 (even, odd)."""
    return _halves(_pair_words(ptr, j, mask))


@triton.jit
def _input_pairs(x_ptr, dx_ptr, nw_ptr, rstd, b, j, B, K, stride_b,
                 ADD: tl.constexpr, NORM: tl.constexpr, EVEN: tl.constexpr):
    """_input_row at columns 2j and 2j + 1 (even, odd; K even), each pair of columns one int32 load."""
    mask = _below(j, tl.where(b < B, K // 2, 0), EVEN)                 # rows past B read as 0
    x_even, x_odd = _pairs(x_ptr + b * stride_b, j, mask)
    if ADD:
        dx_even, dx_odd = _pairs(dx_ptr + b * stride_b, j, mask)
        x_even, x_odd = x_even + dx_even, x_odd + dx_odd
    if NORM:
        x_even, x_odd = _normed_pairs(x_even, x_odd, _pair_words(nw_ptr, j, _below(j, K // 2, EVEN)), rstd)
    return x_even, x_odd


@triton.jit
def _normed_pairs(x_even, x_odd, nw_pair, rstd):
    """_normed_row at columns 2j and 2j + 1 (even, odd), with the norm weight's int32 pairs there (_pair_words)."""
    nw_even, nw_odd = _halves(nw_pair)
    return _round_bf16(x_even * rstd * nw_even), _round_bf16(x_odd * rstd * nw_odd)


@triton.jit
def _load_operand(ptr, mask):
    """A bf16 tile for tl.dot: as stored on the GPU; fp32 under the interpreter (its dot takes fp32)."""
    if IN_INTERPRETER:
        return _load_f32(ptr, mask)
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _put_row(acc, part, offs_b, b):
    """acc[b, :] += part (acc [BLOCK_B, BLOCK_N])."""
    return acc + tl.where(offs_b[:, None] == b, part[None, :], 0.0)


@triton.jit
def _first_step(rstd, k0, x_ptr, dx_ptr, offs_b, B, K, stride_b, eps, ADD: tl.constexpr, BLOCK_B: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN: tl.constexpr, RSTD: tl.constexpr, PDL: tl.constexpr):
    """In the first step of a GEMV's loop, after its first weight loads in program order: wait for the kernel before
    (PDL), then compute rstd (RSTD). Returns rstd."""
    if k0 == 0:
        _pdl_wait(PDL)
        if RSTD:
            rstd = _row_rstd(x_ptr, dx_ptr, offs_b, B, K, stride_b, eps, ADD, BLOCK_B, BLOCK_K, EVEN)
    return rstd


@triton.jit
def _gemv(acc, x_ptr, dx_ptr, nw_ptr, rstd, offs_b, B, stride_b,
          w_ptr, s_ptr, offs_n, N, K: tl.constexpr, eps,
          ADD: tl.constexpr, NORM: tl.constexpr, NVFP4: tl.constexpr,
          BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr, RSTD: tl.constexpr,
          PDL: tl.constexpr):
    """acc[b, n] += input[b, :] . W[offs_n, :] over all of K, for a bf16 or NVFP4 weight (rows offs_n < N); returns
    (acc, rstd). With 16 rows (bf16 weights) on tensor cores (bf16 operands: the values are bf16-exact, so products
    are exact); below, one broadcast multiply-sum per row. EVEN: BLOCK_K divides K, all rows offs_n are < N and all
    BLOCK_B input rows are < B, so no load needs a per-element mask (a third fewer instructions in the NVFP4 GEMV).
    RSTD: the norm's 1 / rms of each row is computed here, in the first step (ptxas issues the first weight tile's
    loads after the reduction's first shuffles; a barrier that put them first measured slower on an H200); one row
    whose K fits one step (ONE) takes it from the same loads as its products, so the input is read once. PDL: the
    first weight tile is loaded (NVFP4 codes also decoded, and ONE's norm weight) before _pdl_wait."""
    ONE: tl.constexpr = RSTD and BLOCK_B == 1 and BLOCK_K >= K
    nmask = _below(offs_n, N, EVEN)
    tl.static_assert(not (NVFP4 and DOT), "NVFP4 GEMVs run one multiply-sum per row")
    if NVFP4:
        # [half-groups of 8 codes, their 4 bytes, BLOCK_N rows], as in _rows_dot: threads along K, the bytes and
        # the input pairs they multiply in one layout; products summed per half-group, then scaled
        H: tl.constexpr = BLOCK_K // 8
        hh = tl.arange(0, H)
        jj = hh[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]                      # [H, 4, 1]
        wide = tl.zeros([H, acc.shape[1]], dtype=tl.float32)             # one row: summed over K at the end
        for k0 in tl.static_range(0, K, BLOCK_K):
            jb = k0 // 2 + jj
            byte = tl.load(w_ptr + offs_n[None, None, :] * (K // 2) + jb,
                           mask=nmask[None, None, :] & _below(jb, K // 2, EVEN), other=0)
            hs = k0 // 16 + hh[:, None] // 2
            sc = _load_f32(s_ptr + offs_n[None, :] * (K // 16) + hs, nmask[None, :] & _below(hs, K // 16, EVEN))
            w_lo, w_hi = _e2m1_pair(byte)                              # (decoded before the wait)
            if ONE:                                                    # (the norm weight too, as int32 pairs:
                nw_pair = _pair_words(nw_ptr, jb, _below(jb, K // 2, EVEN))   # as fp32, qkv took 125 registers
            rstd = _first_step(rstd, k0, x_ptr, dx_ptr, offs_b, B, K, stride_b, eps, ADD, BLOCK_B, BLOCK_K, EVEN,
                               RSTD and not ONE, PDL)
            for b in tl.static_range(BLOCK_B):
                if ONE:
                    x_even, x_odd = _input_pairs(x_ptr, dx_ptr, nw_ptr, 1.0, b, jb, B, K, stride_b, ADD, False, EVEN)
                    r = _rstd(tl.sum(x_even * x_even + x_odd * x_odd), K, eps)
                    x_even, x_odd = _normed_pairs(x_even, x_odd, nw_pair, r)
                    rstd = tl.zeros([BLOCK_B], dtype=tl.float32) + r
                else:
                    rstd_b = tl.sum(tl.where(offs_b == b, rstd, 0.0), 0)
                    x_even, x_odd = _input_pairs(x_ptr, dx_ptr, nw_ptr, rstd_b, b, jb, B, K, stride_b, ADD, NORM,
                                                 EVEN)
                part = tl.sum(w_lo * x_even + w_hi * x_odd, 1) * sc
                if BLOCK_B == 1:
                    wide += part
                else:
                    acc = _put_row(acc, tl.sum(part, 0) * 16384.0, offs_b, b)   # (x 2^14: see _e2m1)
        if BLOCK_B == 1:
            acc += tl.sum(wide, 0)[None, :] * 16384.0
    else:
        offs_k = tl.arange(0, BLOCK_K)
        wide = tl.zeros([acc.shape[1], BLOCK_K], dtype=tl.float32)       # one row: products summed at the end
        for k0 in tl.static_range(0, K, BLOCK_K):
            wmask = nmask[:, None] & _below(k0 + offs_k[None, :], K, EVEN)
            w = _load_f32(w_ptr + offs_n[:, None] * K + k0 + offs_k[None, :], wmask)
            if ONE:                                                    # (the norm weight before the wait too)
                nw = _load_f32(nw_ptr + k0 + offs_k, _below(k0 + offs_k, K, EVEN))
            rstd = _first_step(rstd, k0, x_ptr, dx_ptr, offs_b, B, K, stride_b, eps, ADD, BLOCK_B, BLOCK_K, EVEN, RSTD,
                               PDL)
            if DOT:
                x = _input_rows(x_ptr, dx_ptr, nw_ptr, rstd, offs_b, k0 + offs_k, B, K, stride_b, ADD, NORM, EVEN)
                acc = _dot(acc, x, w)
            else:
                for b in tl.static_range(BLOCK_B):
                    if ONE:
                        x = _input_row(x_ptr, dx_ptr, nw_ptr, 1.0, b, k0 + offs_k, B, K, stride_b, ADD, False, EVEN)
                        r = _rstd(tl.sum(x * x), K, eps)
                        x = _round_bf16(x * r * nw)
                        rstd = tl.zeros([BLOCK_B], dtype=tl.float32) + r
                    else:
                        rstd_b = tl.sum(tl.where(offs_b == b, rstd, 0.0), 0)
                        x = _input_row(x_ptr, dx_ptr, nw_ptr, rstd_b, b, k0 + offs_k, B, K, stride_b, ADD, NORM,
                                       EVEN)
                    if BLOCK_B == 1:
                        wide += w * x[None, :]
                    else:
                        acc = _put_row(acc, tl.sum(w * x[None, :], 1), offs_b, b)
        if BLOCK_B == 1:
            acc += tl.sum(wide, 1)[None, :]
    return acc, rstd


@triton.jit
def _rstd(ss, K, eps):
    """1 / rms of a row of K values from their sum of squares ss (fp32)."""
    return 1.0 / tl.sqrt(ss / K + eps)                  # matches torch.rsqrt to an ulp


@triton.jit
def _row_rstd(x_ptr, dx_ptr, offs_b, B, K, stride_b, eps, ADD: tl.constexpr, BLOCK_B: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """1 / rms of each input row (x + dx summed in fp32), [BLOCK_B]."""
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = _input_rows(x_ptr, dx_ptr, x_ptr, ss, offs_b, k0 + offs_k, B, K, stride_b, ADD, False, EVEN)
        ss += tl.sum(x * x, axis=1)
    return _rstd(ss, K, eps)


@triton.jit
def _head_halves(w_ptr, D: tl.constexpr):
    """A head's norm weight [D] as its two halves (dims d and d + D/2), fp32: _norm_rope's w_a, w_b."""
    d = tl.arange(0, D // 2)
    return tl.load(w_ptr + d).to(tl.float32), tl.load(w_ptr + D // 2 + d).to(tl.float32)


@triton.jit
def _norm_rope(a, b, w_a, w_b, cos, sin, eps, D: tl.constexpr, ROPE: tl.constexpr):
    """Halves a, b [..., D/2] (dims d and d + D/2) of heads, fp32: RMS-normalized over each head with the shared
    weight's halves w_a, w_b (_head_halves) and rounded, then (ROPE) NeoX-rotated by cos, sin (fp32 table rows, [D/2]
    or a's shape) and rounded again. Which product of each rotation the compiler fuses into an FMA follows the code
    around it (since the weights load before the PDL wait, b * cos + a * sin fuses a * sin, not b * cos): 1 fp32 ulp
    that now and then moves a bf16 rounding."""
    rstd = tl.expand_dims(1.0 / tl.sqrt((tl.sum(a * a, -1) + tl.sum(b * b, -1)) / D + eps), -1)
    a = _round_bf16(a * rstd * w_a)
    b = _round_bf16(b * rstd * w_b)
    if ROPE:
        a, b = _round_bf16(a * cos - b * sin), _round_bf16(b * cos + a * sin)
    return a, b


@triton.jit
def _store_add_norm(x_ptr, dx_ptr, nw_ptr, rstd, x_out_ptr, h_out_ptr, offs_b, B, K, stride_b, start, step,
                    ADD: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Store bf16(x + dx) and h = bf16(rmsnorm(x + dx) * nw) of input rows offs_b (outputs: rows of K), at columns
    k0 .. k0 + BLOCK_K for k0 = start, start + step, ... < K."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(start, K, step):
        mask = (offs_b[:, None] < B) & (k0 + offs_k[None, :] < K)
        off = offs_b[:, None] * K + k0 + offs_k[None, :]
        s = _input_rows(x_ptr, dx_ptr, nw_ptr, rstd, offs_b, k0 + offs_k, B, K, stride_b, ADD, False, EVEN)
        h = _input_rows(x_ptr, dx_ptr, nw_ptr, rstd, offs_b, k0 + offs_k, B, K, stride_b, ADD, True, EVEN)
        tl.store(x_out_ptr + off, _to_bf16(s), mask=mask)
        tl.store(h_out_ptr + off, _to_bf16(h), mask=mask)


def _weight_args(w):
    """(main pointer, scale pointer, row-scale pointer, is_nvfp4) for a bf16 tensor or a flint.NVFP4."""
    if hasattr(w, "packed"):
        assert w.packed.is_contiguous() and w.scales.is_contiguous(), "NVFP4 planes must be contiguous"
        return w.packed, w.scales, w.row_scale, True
    assert w.dtype == torch.bfloat16 and w.is_contiguous(), f"weights must be contiguous bf16, got {w.dtype}"
    return w, w, w, False


def _block_b(B, dot=False):
    """Input rows a program takes: 1 alone; 2..8 padded to a power of two, or to 16 on tensor cores (dot). Decode
    steps of more sequences run their weight ops as GEMMs (flint.GEMM_MIN_ROWS)."""
    assert 1 <= B <= 8, f"the decode GEMV kernels take 1..8 rows (more go through GEMMs), got {B}"
    return 1 if B == 1 else 16 if dot else triton.next_power_of_2(B)


# Tiles (BLOCK_N, BLOCK_K, num_warps) per kernel, rows (1; 2-8: one multiply-sum per row; 16: 5-8 bf16 rows padded, on
# tensor cores) and weight format: measured on an H200, the fastest of a sweep over 2..16 x 256..2048 x 2..8 warps
# (16..64 x 64..256 x 4..8 on tensor cores, swept at 64 rows) at Flint's shapes (.dev/tune.py; one warp swept later,
# below), the GEMV ones of 2-8 rows summed over qkv, o and router; the wide ones (the lm_head's GEMV after its norm
# launch) over 2..16 x 512..2048 x 2..8 (.dev/norm1.py); the NVFP4 MoE ones, per batch, over 1..8 x 32..1024 x 2..8
# (.dev/moe_sweep2.py, whose BLOCK_K, the K step, also sets how many threads share a row: K / BLOCK_K steps, BLOCK_K /
# 8 threads). One row apart since 2026-12-04 (.dev/ab.py, us per layer, each op over all its layers in one CUDA
# graph): normed GEMVs of 1024 output rows and up (qkv) bf16 8.28 against 8.79, NVFP4 6.54 against 6.93; plain ones
# (o_proj) bf16 5.89 against 6.49; the router (256 rows: plain tiles, narrowed) 2.61-2.67 either way; the NVFP4
# lm_head 80.5 / 80.2 against 83.1 / 84.1 (.dev/sweep2.py); the dense MLP (normed SwiGLU, then the down GEMV, K steps
# dividing its 6144) bf16 24.23-24.56 against 25.57-25.96, NVFP4 22.28-22.48 against 21.47-21.51 (.dev/dense.py; 2
# layers of 49). The NVFP4 MoE ones since _rows_dot holds a thread's rows at one K (2026-12-04, .dev/rit_ab*.py, us
# per layer over the 47 MoE layers): one row and one warp per program, 256 codes per step, for gate/up and down at
# batch 1, 12.74-12.91 against 14.37-14.55 for the (2, 128, 2) / (2, 64, 4) kept before (24 pairs swept; fewer, larger
# programs slower, up to 20.9); at batch 8 down (1, 256, 1) with gate/up (8, 128, 4), 64.66-65.13 against 65.32-65.47.
# One-warp tiles, swept then for the first time (.dev/warp1.py): only the NVFP4 lm_head gained, 75.3-76.1 us with (4,
# 256, 1) against 85.5-85.8 with (8, 1024, 2); qkv, router, o_proj and the NVFP4 attention + o_proj were fastest as
# kept; the bf16 MoE at batch 1 gained (.dev/bfmoe.py): gate/up (2, 256, 1) with down (1, 512, 2) 17.88-17.92 against
# 18.38-18.60. Swept again after _ranked (.dev/moe_tiles3.py, 8 NVFP4 pairs at batch 1): unchanged. bf16 gate/up at
# batch 1 takes two warps since its shared expert's weights load before the PDL wait, all at once (_rows_dot's WAIT;
# (2, 256, 1) then spills: 255 registers): H200, 2026-12-05 (.dev/rs_ab.py), router + experts us per layer over the
# 47 MoE layers 19.78-20.37 against 20.53-20.57, (1, 256, 2) 20.18-20.67. bf16 down at batch 1 takes one warp since
# it routes the token and loads its weights before the PDL wait (H100s, 2026-12-05, .dev/dr_ab.py, 25 layers, router
# + experts us per layer / whole steps at 512 tok/s, four alternated rounds): (1, 512, 1) 21.05-22.20 / 688-731
# against (1, 512, 2) 22.04-23.70 / 709-712, (2, 512, 1) and (2, 512, 2) no faster; the recorded experts read after
# the wait (before) 23.52-24.07 / 677-716, with (1, 512, 1) 22.96-23.51 / 677-691. Plain GEMVs of one bf16 row (o_proj,
# the router, the dense down) swept again in whole steps with PDL (.dev/ab.py, batch 1 at 4K, alternated rounds, tok/s):
# H100, 2026-12-06, three rounds: (2, 2048, 4) 419.7-420.1 against 414.9-415.3 with the (2, 4096, 8) swept alone
# before PDL; (4, 2048, 4) 419.3-420.4, (1, 2048, 4) 418.2, (2, 2048, 8) 416.5, (2, 1024, 4) 410.5. NVFP4 at one row
# swept again once its kernels took PDL (H100, 2026-12-06, .dev/ab.py, whole steps at batch 1 and 4K, two or three
# alternated rounds, tok/s), against the tiles kept before, (4, 2048, 4) plain and (8, 2048, 8) normed: 573.8-580.0;
# plain (2, 2048, 4) 587.4-595.4, (4, 1024, 2) 565.8-566.7, (8, 2048, 8) 576.1-576.6; normed (4, 2048, 4) 580.4-584.1,
# (8, 1024, 4) 571.7-573.5; MoE gate/up (2, 256, 1) 559.3-560.8, (1, 512, 1) 578.6-579.1; down (1, 512, 1)
# 571.2-575.9; lm_head (8, 256, 1) 573.0-573.9. With the MoE's first weights loaded before the wait (597.1-601.9):
# plain (2, 2048, 4) 611.7-614.0, with normed (4, 2048, 4) 613.8-617.7 (kept); gate/up (1, 2048, 1) 566.5-567.7,
# (1, 1024, 1) 565.5-568.1; down (1, 512, 1) 583.1-584.7. Against those kept (615.9-620.2): plain (1, 2048, 4)
# 618.8-622.9, (2, 2048, 2) 607.8-610.3; normed (2, 2048, 4) 594.3-597.4, (4, 2048, 8) 602.1-603.8, (4, 1024, 4)
# 602.4-604.2; gate/up (1, 128, 1) 592.6-598.5, (1, 256, 2) 536.8-537.9; down (1, 128, 1) 604.3-604.7; lm_head (2,
# 256, 1) 605.1-609.3, (4, 512, 2) 610.2-613.1, (8, 512, 2) 610.2-612.3. Normed again once its norm came from its own
# input loads (a2b238b; H200, 2026-12-06, .dev/ab2.py, whole steps at batch 1 and 4K, tok/s): (4, 2048, 4) 658.1 /
# 649.7, (4, 2048, 2) 676.3 / 667.5 (kept: 95 registers per thread, 0.91 of the GPU's for qkv's 1280 programs against
# 1.06), (2, 2048, 2) 628.6 / 628.1, (2, 2048, 4) 619.8 / 618.1, (8, 2048, 8) 647.6 / 647.0; kept against 6b1dc8b's
# kernels in the same process 671.5 / 667.5 / 667.6 against 651.4 / 646.3 / 646.8.
# NVFP4 down at 2-8 rows takes two rows per program since 2026-12-06 (H100, .dev/ab2.py, whole steps at 4K, three
# rounds, tok/s, the same logits): (2, 256, 1) against (1, 256, 1) at batch 2 783.7 / 783.6 / 788.5 against 772.0 /
# 774.6 / 779.0, batch 4 988.6 / 988.8 / 992.7 against 982.9 / 986.6 / 991.9, batch 8 1132.1 / 1123.2 / 1123.0
# against 1121.3 / 1113.3 / 1112.9; plain GEMVs (2, 2048, 2) and (1, 2048, 4) were slower at 2-4 rows.
TILES = {
    # kernel      rows  nvfp4
    ("gemv",         1, False): (2, 2048, 4),
    ("gemv",         1, True): (2, 2048, 4),
    ("gemv_norm",    1, False): (16, 1024, 4),
    ("gemv_norm",    1, True): (4, 2048, 2),
    ("gemv",         8, False): (2, 2048, 4),                         # (whole steps at batch 2-8, inputs
    ("gemv",         8, True): (2, 2048, 4),                          # normalized apart: .dev/bench_tile.py)
    ("gemv",        16, False): (16, 256, 4),
    ("gemv_wide",    1, False): (4, 2048, 4),
    ("gemv_wide",    1, True): (4, 256, 1),
    ("gemv_wide",    8, False): (8, 2048, 4),
    ("gemv_wide",    8, True): (8, 512, 2),
    ("gemv_wide",   16, False): (16, 256, 4),
    ("moe_gate_up",  1, False): (2, 256, 2),
    ("moe_gate_up",  1, True): (1, 256, 1),
    ("moe_gate_up",  8, False): (8, 1024, 4),
    ("moe_gate_up",  8, True): (8, 128, 4),
    ("moe_down",     1, False): (1, 512, 1),
    ("moe_down",     1, True): (1, 256, 1),
    ("moe_down",     8, False): (4, 512, 4),
    ("moe_down",     8, True): (2, 256, 1),
}


# GEMVs of DOT_MIN_ROWS to 8 bf16 batch rows go to tensor cores from DOT_MIN_N output rows (not the router's 256),
# and one normalized row takes the "gemv_norm" tiles from there;
# off tensor cores, GEMVs of fewer than MIN_PROGRAMS row blocks take narrower blocks (smaller under the
# interpreter, whose tests have tiny shapes)
DOT_MIN_ROWS = 5
DOT_MIN_N, MIN_PROGRAMS = (32, 2) if INTERPRET else (1024, 256)
WIDE_N = 32768                          # GEMVs of this many output rows (the lm_head) take the "gemv_wide" tiles
# A normalized GEMV's first programs store x + dx and h, STORE_K columns each: program 0 storing them all ended last
# (in-kernel timestamps, H100, 2026-12-06: qkv 0.7 us per layer shorter without that store). With one row's norm taken
# from the GEMV's own input loads (_gemv's ONE), whole NVFP4 steps at batch 1, 4K (.dev/ab2.py, three alternated
# rounds, tok/s): H100 640.9 / 633.9 / 634.8 -> 645.4 / 639.6 / 639.3 and 643.5 / 635.9 / 636.0 -> 646.2 / 639.2 /
# 639.0, H200 656.8 / 650.2 / 649.8 -> 660.7 / 651.9 / 652.7 (logits unchanged); qkv 6.45 -> 6.08 us, router 2.82 ->
# 2.60 per layer (H100)
STORE_K = tl.constexpr(16 if INTERPRET else 64)


def tiles(kernel, BLOCK_B, nvfp4, K):
    """(BLOCK_N, BLOCK_K, num_warps) for a GEMV over K-wide rows; small tiles under the interpreter."""
    rows = 1 if BLOCK_B == 1 else 8 if BLOCK_B <= 8 else 16
    BLOCK_N, BLOCK_K, warps = (16, 64, 4) if INTERPRET else TILES[kernel, rows, nvfp4]
    if not INTERPRET:                     # on the GPU, K steps that divide K where they can (no masked last step;
        while K % BLOCK_K and K % (BLOCK_K // 2) == 0:    # the interpreter's tests keep masked steps to check)
            BLOCK_K //= 2
    return BLOCK_N, min(BLOCK_K, max(16, triton.next_power_of_2(K))), warps


# -----------------------------------------------------------------------------
# add_norm_linear / linear: (residual add + RMSNorm +) GEMV (+ SwiGLU)


@triton.jit
def _linear_kernel(
    # pointers
    x_ptr, dx_ptr, nw_ptr, x_out_ptr, h_out_ptr,
    w_ptr, s_ptr, rs_ptr, y_ptr,
    # sizes
    B, N, eps,
    # strides
    stride_xb, stride_yb,
    # meta-parameters
    K: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, NVFP4: tl.constexpr, SWIGLU: tl.constexpr,
    OUT_F32: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    tl.static_assert(not NORM or BLOCK_B == 1, "inputs of 2-8 rows are normalized apart (_launch_linear)")
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    DOT: tl.constexpr = BLOCK_B >= 16
    N_out = N // 2 if SWIGLU else N
    nmask = _below(offs_n, N_out, EVEN)
    if NVFP4:                                    # the row scales before the wait too: loaded after the products,
        rs_g = _load_f32(rs_ptr + offs_n, nmask)                      # they cost a round trip at the end
        rs_u = _load_f32(rs_ptr + N_out + offs_n, nmask) if SWIGLU else rs_g
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    acc, rstd = _gemv(acc, x_ptr, dx_ptr, nw_ptr, tl.zeros([BLOCK_B], dtype=tl.float32), offs_b, B, stride_xb,
                      w_ptr, s_ptr, offs_n, N_out, K, eps, ADD, NORM, NVFP4, BLOCK_B, BLOCK_K, DOT, EVEN, NORM, PDL)
    if NORM:                                     # x + dx and h, STORE_K columns by each of the first programs
        _store_add_norm(x_ptr, dx_ptr, nw_ptr, rstd, x_out_ptr, h_out_ptr, offs_b, B, K, stride_xb, pid * STORE_K,
                        tl.num_programs(0) * STORE_K, ADD, STORE_K, EVEN and BLOCK_K >= STORE_K)   # (powers of 2)
    if NVFP4:
        acc *= rs_g[None, :]
    if SWIGLU:                                                        # up rows follow the gate rows
        u = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        u, _ = _gemv(u, x_ptr, dx_ptr, nw_ptr, rstd, offs_b, B, stride_xb, w_ptr + N_out * (K // 2 if NVFP4 else K),
                     s_ptr + N_out * (K // 16), offs_n, N_out, K, eps, ADD, NORM, NVFP4, BLOCK_B, BLOCK_K, DOT, EVEN,
                     False, False)
        if NVFP4:
            u *= rs_u[None, :]
        g, u = _round_bf16(acc), _round_bf16(u)                       # the dense gate/up GEMMs output bf16
        acc = g / (1.0 + tl.exp(-g)) * u
    mask = (offs_b[:, None] < B) & nmask[None, :]
    y = acc if OUT_F32 else _to_bf16(acc)
    tl.store(y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :], y, mask=mask)


def _launch_linear(x, dx, norm_w, w, eps, swiglu=False, f32=False):
    B, K = x.shape
    wp, sp, rsp, nvfp4 = _weight_args(w)
    N = w.shape[0]
    assert w.shape[-1] == K, f"weight {tuple(w.shape)} does not take inputs of width {K}"
    assert x.is_contiguous() and x.dtype == torch.bfloat16, "inputs must be contiguous bf16 rows"
    N_out = N // 2 if swiglu else N
    norm = norm_w is not None
    pdl = _pdl(x)
    if norm and (B > 1 or N_out >= WIDE_N):
        # the norm in a launch of its own where every program would normalize much: 2-8 rows, or one row for the
        # lm_head's 37,536 programs (H200, 2026-12-03, us: qkv at batch 8 NVFP4 24.8 against 42.4, bf16 17.2 against
        # 25.5; router at batch 8 7.6 against 10.8; lm_head at batch 1 NVFP4 92.6 against 133.8, bf16 142.1 against
        # 146.0). One row of qkv or the router is faster normalized in every program (7.1 against 7.7, 2.7 against 3.8)
        x_out, h_out = _add_rms_norm(x, dx, norm_w, eps, pdl)
        return x_out, h_out, _launch_linear(h_out, None, None, w, eps, swiglu, f32)[2]
    y = torch.empty(B, N_out, device=x.device, dtype=torch.float32 if f32 else torch.bfloat16)
    x_out = torch.empty_like(x) if norm else x
    h_out = torch.empty_like(x) if norm else x
    # (H200, batch 8: bf16 881.8 tok/s on tensor cores against 667.0; NVFP4 442.1 against 633.8, so not NVFP4)
    BLOCK_B = _block_b(B, dot=B >= DOT_MIN_ROWS and not nvfp4 and N_out >= DOT_MIN_N)
    kind = "gemv_wide" if N_out >= WIDE_N else "gemv_norm" if norm and N_out >= DOT_MIN_N else "gemv"
    BLOCK_N, BLOCK_K, warps = tiles(kind, BLOCK_B, nvfp4, K)
    while BLOCK_B < 16 and BLOCK_N > 1 and N_out // BLOCK_N < MIN_PROGRAMS:
        BLOCK_N //= 2
    grid = (triton.cdiv(N_out, BLOCK_N),)
    _linear_kernel[grid](
        x, dx if dx is not None else x, norm_w if norm else x, x_out, h_out,
        wp, sp, rsp, y,
        B, N, eps,
        x.stride(0), y.stride(0),
        K=K, ADD=dx is not None, NORM=norm, NVFP4=nvfp4, SWIGLU=swiglu, OUT_F32=f32,
        BLOCK_B=BLOCK_B, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        EVEN=N_out % BLOCK_N == 0 and K % BLOCK_K == 0 and B == BLOCK_B, PDL=pdl, num_warps=warps,
        launch_pdl=pdl > 0)
    return x_out, h_out, y


def add_norm_linear(x, dx, norm_w, w, eps, f32=False):
    """x, dx [N, C] bf16 (dx may be None) -> (bf16(x + dx), h = rmsnorm(x + dx), h @ w^T) (fp32 if f32)."""
    return _launch_linear(x, dx, norm_w, w, eps, f32=f32)


def add_norm_swiglu(x, dx, norm_w, gate_up, eps):
    """Dense MLP input: -> (bf16(x + dx), silu(h @ gate^T) * (h @ up^T)); gate_up rows: gate, then up."""
    x, _, act = _launch_linear(x, dx, norm_w, gate_up, eps, swiglu=True)
    return x, act


def linear(x, w):
    """x [N, K] bf16 -> x @ w^T bf16."""
    return _launch_linear(x, None, None, w, 0.0)[2]


# -----------------------------------------------------------------------------
# attention_decode: q/k norm + RoPE + KV write + split-KV attention with sinks, then combine


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, cache_b, slot, mask, stride_cs, D: tl.constexpr):
    """Keys (halves: dims d and d + D/2) and values [len(slot), ...] of one kv head at cache slots `slot`, as tl.dot
    operands; masked slots read as 0."""
    offs_d, offs_v = tl.arange(0, D // 2), tl.arange(0, D)
    kc = k_cache_ptr + cache_b + slot[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
    vc = v_cache_ptr + cache_b + slot[:, None].to(tl.int64) * stride_cs + offs_v[None, :]
    return _load_operand(kc, mask[:, None]), _load_operand(kc + D // 2, mask[:, None]), _load_operand(vc, mask[:, None])


@triton.jit
def _attend(q1, q2, k1, k2, v, kt1, kt2, vt, slot, newest, p, end, m_i, l_i, acc, qk_scale, RING: tl.constexpr):
    """One online-softmax step of the query rows (halves q1, q2) over the cached keys and values kt1, kt2, vt of
    `slot`: slots below end that were written (slot <= p) are visible. RING (sliding layers): slot `newest` takes
    this token's k1, k2, v from registers (another program may be writing it right now). Full layers read only
    slots below newest, so their tiles go to the tensor cores as loaded (the substitution would take each tile from
    shared memory to registers and back). Returns the running max m_i (log2 units), row sum l_i and unnormalized
    output acc, updated."""
    is_new, visible = slot == newest, (slot < end) & (slot <= p)
    if RING:
        kt1 = tl.where(is_new[:, None], k1[None, :].to(kt1.dtype), kt1)
        kt2 = tl.where(is_new[:, None], k2[None, :].to(kt2.dtype), kt2)
        vt = tl.where(is_new[:, None], v[None, :].to(vt.dtype), vt)
    s = _dot(_dot(tl.zeros([q1.shape[0], kt1.shape[0]], dtype=tl.float32), q1, kt1), q2, kt2)
    s = tl.where(visible[None, :], s * qk_scale, float("-inf"))       # log2 units: scale * log2(e) folded in
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)              # nothing visible yet: all weights 0
    alpha = tl.exp2(m_i - m_ref)
    pexp = tl.exp2(s - m_ref[:, None])
    # unnormalized P rounded to bf16 for P @ V (the serving reference), fp32 row sum
    return m_new, l_i * alpha + tl.sum(pexp, 1), _dot(acc * alpha[:, None], _round_bf16(pexp), tl.trans(vt))


@triton.jit
def _attention_decode_kernel(
    # pointers
    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
    m_ptr, l_ptr, acc_ptr,
    # sizes
    S, eps, qk_scale,
    # strides
    stride_qkv, stride_cb, stride_cs,
    # meta-parameters
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    b, g, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    R: tl.constexpr = H // G                                          # query heads per kv head
    HALF: tl.constexpr = D // 2
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HALF)
    offs_v = tl.arange(0, D)
    offs_s = tl.arange(0, BLOCK_S)
    rmask = offs_r[:, None] < R
    row = qkv_ptr + b * stride_qkv
    cache_b = b.to(tl.int64) * stride_cb + g * D
    if WINDOW > 0:
        # Sliding layers: the ring's S slots hold the last S positions, and slot i is visible once written
        # (i <= p) whatever position it holds (the softmax sum does not care about key order). So this split's
        # slots are known before the position is read, and its first tile's loads go first.
        chunk = tl.cdiv(tl.cdiv(S, NUM_SPLITS), BLOCK_S) * BLOCK_S
        start = split * chunk
        end = tl.minimum(start + chunk, S)
        kt1, kt2, vt = _kv_tile(k_cache_ptr, v_cache_ptr, cache_b, start + offs_s, start + offs_s < end,
                                stride_cs, D)
    qn_a, qn_b = _head_halves(qn_ptr, D)                              # (the q/k norm weights before the wait too)
    kn_a, kn_b = _head_halves(kn_ptr, D)
    _pdl_wait(PDL)                                                    # (the slots read are earlier steps')
    p = tl.load(pos_ptr + b)

    # ---- q of the R heads of group g and this token's k, v: per-head RMSNorm (shared weight), rounded, then
    # NeoX RoPE on sliding layers over the halves (d, d + D/2) from the fp32 table, rounded once
    q_ptr = row + (g * R + offs_r[:, None]) * D + offs_d[None, :]
    q1, q2 = _load_f32(q_ptr, rmask), _load_f32(q_ptr + HALF, rmask)
    k_ptr = row + (H + g) * D + offs_d
    k1, k2 = _load_f32(k_ptr, offs_d < HALF), _load_f32(k_ptr + HALF, offs_d < HALF)
    v = _load_f32(row + (H + G + g) * D + offs_v, offs_v < D)
    cos, sin = tl.zeros([HALF], dtype=tl.float32), tl.zeros([HALF], dtype=tl.float32)  # full: no RoPE
    if WINDOW > 0:
        cos, sin = tl.load(cos_ptr + p * HALF + offs_d), tl.load(sin_ptr + p * HALF + offs_d)
    q1, q2 = _norm_rope(q1, q2, qn_a, qn_b, cos, sin, eps, D, WINDOW > 0)
    k1, k2 = _norm_rope(k1, k2, kn_a, kn_b, cos, sin, eps, D, WINDOW > 0)

    # ---- store k, v at slot p % S (the ring on sliding layers; S = max length on full layers, p < S)
    newest = p % S
    if split == 0:
        new = cache_b + newest.to(tl.int64) * stride_cs
        tl.store(k_cache_ptr + new + offs_d, _to_bf16(k1))
        tl.store(k_cache_ptr + new + HALF + offs_d, _to_bf16(k2))
        tl.store(v_cache_ptr + new + offs_v, _to_bf16(v))

    # ---- attend over this split's slots start .. end - 1
    RING: tl.constexpr = WINDOW > 0
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    if RING:                                                          # the tile loaded first
        m_i, l_i, acc = _attend(q1, q2, k1, k2, v, kt1, kt2, vt, start + offs_s, newest, p, end, m_i, l_i, acc,
                                qk_scale, RING)
        first = start + BLOCK_S                                       # (more tiles: batches of fewer splits)
    else:
        # full layers: slot = position; the p cached keys in NUM_SPLITS contiguous shares, and this token's own
        # key and value (from registers) as split 0's first term: its score is the running max, its weight 1
        chunk = tl.cdiv(tl.cdiv(p, NUM_SPLITS), BLOCK_S) * BLOCK_S
        first = split * chunk
        end = tl.minimum(first + chunk, p)
        if split == 0:
            m_i = (tl.sum(q1 * k1[None, :], 1) + tl.sum(q2 * k2[None, :], 1)) * qk_scale
            l_i = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
            acc = tl.broadcast_to(v[None, :], [BLOCK_R, D])
    for s0 in range(first, end, BLOCK_S):
        slot = s0 + offs_s
        kt1, kt2, vt = _kv_tile(k_cache_ptr, v_cache_ptr, cache_b, slot, slot < end, stride_cs, D)
        m_i, l_i, acc = _attend(q1, q2, k1, k2, v, kt1, kt2, vt, slot, newest, p, end, m_i, l_i, acc, qk_scale,
                                RING)

    # ---- partials [B, H, NUM_SPLITS] (m in log2 units) and [B, H, NUM_SPLITS, D]
    h = g * R + offs_r
    part = (b * H + h) * NUM_SPLITS + split
    tl.store(m_ptr + part, m_i, mask=offs_r < R)
    tl.store(l_ptr + part, l_i, mask=offs_r < R)
    tl.store(acc_ptr + part[:, None] * D + offs_v[None, :], acc, mask=rmask)


@triton.jit
def _attention_combine_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, o_ptr,
                              H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                              SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, head h, block of BLOCK_D dims): the attention output o [B, H * D] bf16 from the splits'
    partials, o = sum_s acc_s 2^(m_s - M) / (sum_s l_s 2^(m_s - M) + e^(sink - M')), M = max(m_s, sink)."""
    b, h, d0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BLOCK_D
    _pdl_wait(PDL)
    offs_s = tl.arange(0, SPLITS_PAD)
    smask = offs_s < NUM_SPLITS
    offs_d = d0 + tl.arange(0, BLOCK_D)
    part = (b * H + h) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    sink = tl.load(sinks_ptr + h) * 1.4426950408889634               # the sink is a scaled-score logit: to log2
    m_all = tl.maximum(tl.max(m, 0), sink)
    w = tl.exp2(m - m_all)                                            # empty splits: 2^-inf = 0
    denom = tl.sum(l * w, 0) + tl.exp2(sink - m_all)
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(o_ptr + (b * H + h) * D + d0 + tl.arange(0, BLOCK_D), _to_bf16(o))


# Tiles of the split-KV attention by kind of layer, each the fastest of sweeps: splits (sliding: of the window; full:
# min_splits, or one per keys_per_split slots of a longer cache, up to 128), keys per step (block), warps, stages.
# Larger batches take fewer splits, down to ~`programs` programs. Full layers' splits hold at least min_keys slots of
# the cache. Splits of one key step take short_stages (the pipeline's tile ahead goes unused): H200, 2026-12-05, bf16
# full layers over caches of 520 slots 10.59-10.65 against 12.54-12.99 us per layer with 32 splits and 3 stages;
# sliding layers at batch 1 (17 splits of 32 keys), H100, 2026-12-06, whole bf16 steps (.dev/ab.py, two rounds) at
# 512 / 4K 414.8-415.4 / 410.6 against 411.6-413.5 / 406.1-407.0 tok/s with 3 stages; but at batch 2 / 4 (also 17
# splits of one step) 3 stages stay faster, 4K 548.9 / 743.5 against 538.5 / 736.4.
# - sliding: H200, 2026-12-03, us per layer at batch 1 / 8 / 64: 6.90 / 15.62 / 37.23 against 16 x 64 keys 6.86 /
#   20.06 / 44.07 and 16 x 16 7.14 / 15.16 / 45.58.
# - full (the combine in its own launch): H100, 2026-12-05, bf16 attention + combine + o_proj, us per full layer
#   (.dev/attn_sweep.py): 128 splits of 32-key steps, 2 warps, 2 stages at 2K / 4K / 8K / 16K 12.60-12.86 / 14.49-14.60
#   / 17.83-17.84 / 23.76-24.53 against the tiles of the combine inside o_proj (below) 14.05-14.48 / 16.00-16.03 /
#   19.01-19.21 / 24.63-24.90. Then 64-key steps and 4 warps: H200, 2026-12-06, whole bf16 steps (.dev/ab.py, two
#   rounds, tok/s) at batch 1, 512 / 4K / 32K 517.2-517.8 / 513.0-513.2 / 464.6-466.4 against 510.2-510.6 / 508.1-509.6
#   / 455.3-456.3, at batch 8, 4K / 32K 1057.4-1057.9 / 877.4-879.2 against 1050.9-1051.3 / 854.5-856.0; NVFP4 batch 8
#   1120.7-1122.2 / 933.0-933.1 against 1118.1-1118.2 / 923.5-938.9. With 3 stages, 256 splits or 8 warps: no better.
# The combine launch takes one program per combine_d dims of a head (default: all D). Full layers with 32: H200,
# 2026-12-06, whole bf16 steps at batch 1 (.dev/ab.py, two rounds of chained steps, tok/s) at 512 / 4K / 32K 494.9-494.8
# / 490.0-491.6 / 439.2-439.6 against 492.7-500.4 / 486.7-488.8 / 438.0-438.8 with whole heads; H100 at 4K 411.6-411.7
# against 409.7-410.5. Sliding layers with 32 (H100, 2026-12-06, same method): 427.5-433.2 / 423.1-423.2 / 380.3-380.4
# against 425.3-429.2 / 421.3-422.6 / 378.9, and at 4K in another run 425.2 against 422.5, with 64 423.9.
ATTENTION = dict(sliding=dict(splits=32, block=32, warps=8, stages=3, combine_d=32),
                 full=dict(min_splits=128, block=64, warps=4, stages=2, combine_d=32),
                 keys_per_split=1024, min_keys=32, short_stages=2, programs=512)
_SMALL = dict(splits=2, min_splits=4, block=16, warps=4, stages=1)  # the interpreter runs programs one by one
ATTENTION_INTERPRETER = dict(sliding=dict(_SMALL, combine_d=8), full=dict(_SMALL, combine_d=8),
                             keys_per_split=16, min_keys=8, short_stages=1, programs=8)
# The splits' combine inside o_proj (one kernel whose programs each combine one head and add its share of o_proj to
# int64 fixed-point sums, which the next norm read) was kept for NVFP4 at batch 1 until its kernels took PDL too, then
# was slower than the combine launch and the o_proj GEMV (README, "How the decode kernels got here").


def attention_decode(qkv, q_norm, k_norm, sinks, cos, sin, k_cache, v_cache, pos, window, eps, w_o):
    """One new token per row. qkv [B, (H+2G)D] bf16 (before q/k norm and RoPE); caches [B, S, G, D]; pos [B];
    window 0 = full layer (no RoPE). Writes the token's k, v at slot pos % S; returns o_proj(o) [B, C] bf16, or
    with w_o None the attention output o [B, H*D] bf16."""
    B, S, G, D = k_cache.shape
    H = sinks.shape[0]
    assert qkv.shape == (B, (H + 2 * G) * D) and qkv.is_contiguous() and qkv.dtype == torch.bfloat16
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == torch.bfloat16
    assert pos.shape == (B,) and sinks.dtype == torch.float32 and cos.dtype == torch.float32
    assert not window or S <= window, f"a sliding layer's ring holds at most {window} slots, got {S}"
    t = ATTENTION_INTERPRETER if INTERPRET else ATTENTION           # (GPU: programs to fill it at batch 1, 4 kv heads)
    tile = t["sliding" if window else "full"]
    if window:
        NUM_SPLITS = tile["splits"]
    else:                                       # (min_splits up, but no more than a cache's S // min_keys)
        NUM_SPLITS = max(tile["min_splits"], min(128, triton.next_power_of_2(triton.cdiv(S, t["keys_per_split"]))))
        NUM_SPLITS = min(NUM_SPLITS, 1 << (max(1, S // t["min_keys"]).bit_length() - 1))
    NUM_SPLITS = min(NUM_SPLITS, triton.next_power_of_2(triton.cdiv(t["programs"], B * G)))  # (fewer partials)
    BLOCK_S, warps, stages = tile["block"], tile["warps"], tile["stages"]
    if window:                                                        # one tile per split when it fits, and
        BLOCK_S = max(16, min(BLOCK_S, triton.next_power_of_2(triton.cdiv(S, NUM_SPLITS))))
        NUM_SPLITS = min(NUM_SPLITS, triton.cdiv(S, BLOCK_S))         # no empty splits (513 slots: 17 of 32)
    if triton.cdiv(S, NUM_SPLITS) <= BLOCK_S and (B == 1 or not window):  # one key step per split: no tile ahead
        stages = min(stages, t["short_stages"])                           # (sliding at 2-4 rows: 3 stages faster)
    SPLITS_PAD = triton.next_power_of_2(NUM_SPLITS)
    m = torch.empty(B, H, NUM_SPLITS, device=qkv.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B, H, NUM_SPLITS, D, device=qkv.device, dtype=torch.float32)
    pdl = _pdl(qkv) if w_o is not None else 0                        # (none in the GEMM path: no o_proj here)
    _attention_decode_kernel[(B, G, NUM_SPLITS)](
        qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos,
        m, l, acc,
        S, eps, D ** -0.5 * LOG2E,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
        H=H, G=G, D=D, WINDOW=window, NUM_SPLITS=NUM_SPLITS,
        BLOCK_R=max(16, triton.next_power_of_2(H // G)), BLOCK_S=BLOCK_S, PDL=pdl, num_warps=warps,
        num_stages=stages, launch_pdl=pdl > 0)
    o = torch.empty(B, H * D, device=qkv.device, dtype=torch.bfloat16)
    BLOCK_D = min(D, tile["combine_d"])
    _attention_combine_kernel[(B, H, D // BLOCK_D)](
        m, l, acc, sinks, o, H=H, D=D, BLOCK_D=BLOCK_D, NUM_SPLITS=NUM_SPLITS, SPLITS_PAD=SPLITS_PAD,
        PDL=pdl, num_warps=4 if BLOCK_D == D else 1, launch_pdl=pdl > 0)
    return o if w_o is None else linear(o, w_o)


# -----------------------------------------------------------------------------
# sink_attention: prefill attention with sinks (flash attention over keys named by their positions)


@triton.jit
def _sink_attention_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, sinks_ptr, qpos_ptr, kpos_ptr, o_ptr,
    # sizes
    T, S, qk_scale,
    # strides (q and o: [B, T, H, D]; k, v: [B, S, G, D]; positions: [B, T] and [B, S])
    stride_qb, stride_qt, stride_kb, stride_ks, stride_vb, stride_vs, stride_qpb, stride_kpb,
    # meta-parameters
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (query block, kv head g, row b): BLOCK_M queries x the R query heads of group g as one tile of
    BLOCK_M * BLOCK_R rows, so the group's heads share each K/V tile. Keys are visible by position, as in
    sink_attention_ref; the sink joins the softmax denominator at the end."""
    mb, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)   # B long rows: > 2^31 elements
    R: tl.constexpr = H // G
    ROWS: tl.constexpr = BLOCK_M * BLOCK_R
    rows = tl.arange(0, ROWS)
    t = mb * BLOCK_M + rows // BLOCK_R                                # query index of each row
    r = rows % BLOCK_R                                                # head within the group
    rmask = (t < T) & (r < R)
    offs_d = tl.arange(0, D)
    q = _load_f32(q_ptr + b * stride_qb + t[:, None] * stride_qt + (g * R + r[:, None]) * D + offs_d[None, :],
                  rmask[:, None])
    qp = tl.load(qpos_ptr + b * stride_qpb + t, mask=rmask, other=0)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # keys come in position order (k_pos[i] = k_pos[0] + i): only those from the block's first query's window
    # start to its last query can be visible
    base = tl.load(kpos_ptr + b * stride_kpb)
    hi = tl.minimum(tl.max(tl.where(rmask, qp, -1), 0) - base + 1, S)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(tl.min(tl.where(rmask, qp, 2**30), 0) - WINDOW + 1 - base, 0) // BLOCK_N * BLOCK_N
    for s0 in range(lo, hi, BLOCK_N):
        s = s0 + offs_n
        smask = s < S
        kp = tl.load(kpos_ptr + b * stride_kpb + s, mask=smask, other=-1)
        kt = _load_f32(k_ptr + b * stride_kb + s[:, None] * stride_ks + g * D + offs_d[None, :], smask[:, None])
        vt = _load_f32(v_ptr + b * stride_vb + s[:, None] * stride_vs + g * D + offs_d[None, :], smask[:, None])
        if IN_INTERPRETER:
            sc = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            sc = tl.dot(q.to(tl.bfloat16), tl.trans(kt.to(tl.bfloat16)))
        dist = qp[:, None] - kp[None, :]
        visible = (kp[None, :] >= 0) & (dist >= 0) & rmask[:, None]
        if WINDOW > 0:
            visible &= dist < WINDOW
        sc = tl.where(visible, sc * qk_scale, float("-inf"))         # log2 units
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)         # no visible key yet: keep zeros
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IN_INTERPRETER:
            pv = tl.dot(_round_bf16(p), vt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(tl.bfloat16), vt.to(tl.bfloat16))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    sink = tl.load(sinks_ptr + g * R + r, mask=r < R, other=0.0) * 1.4426950408889634   # to log2 units
    m_all = tl.maximum(m_i, sink)
    scale = tl.exp2(m_i - m_all)                                      # no visible key: 2^-inf = 0
    o = acc * scale[:, None] / (l_i * scale + tl.exp2(sink - m_all))[:, None]
    tl.store(o_ptr + b * stride_qb + t[:, None] * stride_qt + (g * R + r[:, None]) * D + offs_d[None, :],
             _to_bf16(o), mask=rmask[:, None])


def sink_attention(q, k, v, sinks, q_pos, k_pos, window):
    """q [B, T, H, D] bf16; k, v [B, S, G, D] bf16 (rows of a cache may be strided); sinks [H] fp32; q_pos
    [B, T], k_pos [B, S] (negative: empty slot); window 0 = full. Returns o [B, T, H, D] bf16 (see
    sink_attention_ref). Keys must come in position order, k_pos[b, i] = k_pos[b, 0] + i wherever visible (as
    KVCache.store returns them): each query block reads only the keys its queries can see."""
    B, T, H, D = q.shape
    S, G = k.shape[1], k.shape[2]
    assert q.is_contiguous() and q.dtype == k.dtype == v.dtype == torch.bfloat16 and sinks.dtype == torch.float32
    assert k.stride(2) == D and k.stride(3) == 1 and v.stride(2) == D and v.stride(3) == 1, "heads must be packed"
    assert q_pos.stride(1) == 1 and k_pos.stride(1) == 1
    o = torch.empty_like(q)
    BLOCK_R = triton.next_power_of_2(H // G)
    BLOCK_M = max(1, (16 if INTERPRET else 128) // BLOCK_R)           # 128 rows of (query, head) per tile
    BLOCK_N = 16 if INTERPRET else 64
    _sink_attention_kernel[(triton.cdiv(T, BLOCK_M), G, B)](
        q, k, v, sinks, q_pos, k_pos, o,
        T, S, D ** -0.5 * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_pos.stride(0),
        k_pos.stride(0),
        H=H, G=G, D=D, WINDOW=window, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=8)
    return o


# -----------------------------------------------------------------------------
# Prompt chunks: residual add + RMSNorm, and q/k RMSNorm + RoPE, one pass over the rows each


@triton.jit
def _add_rms_norm_kernel(x_ptr, dx_ptr, w_ptr, s_ptr, h_ptr, N, C, eps, ADD: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BLOCK_R rows of C <= BLOCK_C columns): the residual add + RMSNorm that add_norm_linear's
    first programs store, from one load of x (+ dx); the norm weight is loaded before the PDL wait."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK_C)
    w = _load_f32(w_ptr + offs, _below(offs, C, EVEN))
    _pdl_wait(PDL)
    x = _input_rows(x_ptr, dx_ptr, w_ptr, 1.0, rows, offs, N, C, C, ADD, False, EVEN)       # (not normalized here)
    rstd = _rstd(tl.sum(x * x, 1), C, eps)
    mask = (rows[:, None] < N) & _below(offs, C, EVEN)[None, :]
    out = rows[:, None] * C + offs[None, :]
    tl.store(s_ptr + out, _to_bf16(x), mask=mask)
    tl.store(h_ptr + out, _to_bf16(x * rstd[:, None] * w[None, :]), mask=mask)


def add_rms_norm(x, dx, w, eps):
    """x, dx [N, C] bf16 (dx may be None) -> (bf16(x + dx), rmsnorm(x + dx) * w), as add_rms_norm_ref."""
    return _add_rms_norm(x, dx, w, eps, 0)


def _add_rms_norm(x, dx, w, eps, pdl):
    N, C = x.shape
    assert x.is_contiguous() and x.dtype == torch.bfloat16 and (dx is None or dx.is_contiguous())
    s, h = torch.empty_like(x), torch.empty_like(x)
    BLOCK_C = triton.next_power_of_2(C)
    BLOCK_R = min(16, triton.next_power_of_2(N)) if INTERPRET else 1  # (a row per program; fewer in the tests)
    _add_rms_norm_kernel[(triton.cdiv(N, BLOCK_R),)](x, x if dx is None else dx, w, s, h, N, C, eps,
                                                     ADD=dx is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                                                     EVEN=BLOCK_C == C, PDL=pdl, num_warps=4, launch_pdl=pdl > 0)
    return s, h


@triton.jit
def _heads_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, n, heads, stride_x, eps,
                            ROPE: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (block of BLOCK_H heads, counted row by row over the rows' n heads [D] each, stride_x apart):
    _norm_rope of each head at its row's cos, sin on sliding layers; y [rows, n, D]."""
    HALF: tl.constexpr = D // 2
    i = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    row = i // n
    d = tl.arange(0, HALF)
    mask = (i < heads)[:, None] & (d < HALF)[None, :]
    lo = x_ptr + row[:, None] * stride_x + (i % n)[:, None] * D + d[None, :]
    cos, sin = tl.zeros([BLOCK_H, HALF], dtype=tl.float32), tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    if ROPE:                                                          # (full layers: none)
        cos, sin = _load_f32(cos_ptr + row[:, None] * HALF + d[None, :], mask), \
            _load_f32(sin_ptr + row[:, None] * HALF + d[None, :], mask)
    w_a, w_b = _head_halves(w_ptr, D)
    a, b = _norm_rope(_load_f32(lo, mask), _load_f32(lo + HALF, mask), w_a, w_b, cos, sin, eps, D, ROPE)
    out = y_ptr + i[:, None] * D + d[None, :]
    tl.store(out, _to_bf16(a), mask=mask)
    tl.store(out + HALF, _to_bf16(b), mask=mask)


def qk_norm_rope(q, k, q_norm, k_norm, cos, sin, eps):
    """q [B, T, H, D], k [B, T, G, D] bf16 (views into the qkv rows) -> contiguous q, k, as qk_norm_rope_ref."""
    out = []
    for x, w in ((q, q_norm), (k, k_norm)):
        B, T, n, D = x.shape
        assert x.stride(0) == T * x.stride(1) and x.stride(2) == D and x.stride(3) == 1, "rows of packed heads"
        y = torch.empty(B, T, n, D, device=x.device, dtype=x.dtype)
        BLOCK_H, rope = 32, cos is not None
        _heads_norm_rope_kernel[(triton.cdiv(B * T * n, BLOCK_H),)](
            x, w, cos.contiguous() if rope else w, sin.contiguous() if rope else w, y, n, B * T * n, x.stride(1),
            eps, ROPE=rope, D=D, BLOCK_H=BLOCK_H, num_warps=4)
        out.append(y)
    return tuple(out)


# -----------------------------------------------------------------------------
# moe_experts: routing + gate/up + SwiGLU (routed and shared) in one launch; down + combine in another


@triton.jit
def _ordered(bits, MAGNITUDE: tl.constexpr):
    """int32 bits of an fp32 value (MAGNITUDE 0x7FFFFFFF), or of a bf16 one in the upper half (0x7FFF0000) <-> an
    int32 that orders like the values: a negative value's magnitude bits flipped (its own inverse)."""
    return bits ^ ((bits >> 31) & MAGNITUDE)


@triton.jit
def _route_keys(logits_ptr, b, E: tl.constexpr):
    """Token b's E router logits as int32 keys that order like the logits and are distinct: the bf16 logit's bits
    in the upper half (made to order like the values: a negative one's magnitude bits flipped, -0 taken as +0),
    0xFFFF - expert in the lower half (ties: lowest index first). Read from L2 (.cg): the decode MoE down kernel
    reads them while the kernel before it still runs (_moe_down_kernel)."""
    offs_e = tl.arange(0, E)
    r = tl.load(logits_ptr + b * E + offs_e, cache_modifier=".cg").to(tl.float32)
    bits = tl.where(r == 0.0, 0.0, r).to(tl.int32, bitcast=True)    # a bf16: the lower 16 bits are zero
    return _ordered(bits, 0x7FFF0000) | (0xFFFF - offs_e)


@triton.jit
def _ranked(logits_ptr, b, j, E: tl.constexpr):
    """The expert of rank j (0: the highest logit) among token b's, as _route picks them: j + 1 maxima, not A."""
    key = _route_keys(logits_ptr, b, E)
    for _ in range(j):
        key = tl.where(key == tl.max(key, 0), -2147483648, key)
    return 0xFFFF - (tl.max(key, 0) & 0xFFFF)


@triton.jit
def _route(logits_ptr, b, E: tl.constexpr, A: tl.constexpr, A_PAD: tl.constexpr, NORM_TOPK: tl.constexpr):
    """Top-A experts of token b by router logit (ties: lowest index) and their weights sigmoid / sum, [A_PAD]:
    one max of the keys (_route_keys) per pick."""
    key = _route_keys(logits_ptr, b, E)
    offs_a = tl.arange(0, A_PAD)
    ids = tl.zeros([A_PAD], dtype=tl.int32)
    vals = tl.zeros([A_PAD], dtype=tl.float32)
    for a in tl.static_range(A):
        best = tl.max(key, 0)
        ids = tl.where(offs_a == a, 0xFFFF - (best & 0xFFFF), ids)
        vals = tl.where(offs_a == a, _ordered(best & -65536, 0x7FFF0000).to(tl.float32, bitcast=True), vals)
        key = tl.where(key == best, -2147483648, key)                 # (keys are distinct: taken once)
    w = tl.where(offs_a < A, 1.0 / (1.0 + tl.exp(-vals)), 0.0)       # sigmoid of the chosen logits
    if NORM_TOPK:
        w = w / (tl.sum(w, 0) + 1e-20)
    return ids, _round_bf16(w)


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, wts_ptr, E: tl.constexpr, A: tl.constexpr, A_PAD: tl.constexpr,
                  NORM_TOPK: tl.constexpr):
    """Program token b: its top-A experts and their weights (prompt chunks; decode routes inside the MoE kernel)."""
    b = tl.program_id(0).to(tl.int64)
    ids, wts = _route(logits_ptr, b, E, A, A_PAD, NORM_TOPK)
    offs_a = tl.arange(0, A_PAD)
    tl.store(ids_ptr + b * A + offs_a, ids.to(tl.int64), mask=offs_a < A)
    tl.store(wts_ptr + b * A + offs_a, _to_bf16(wts), mask=offs_a < A)


def route(logits, top_k, norm_topk_prob):
    """Router logits [N, E] bf16 -> (weights [N, A] bf16, experts [N, A] int64), as route_ref."""
    N, E = logits.shape
    assert logits.is_contiguous() and logits.dtype == torch.bfloat16 and E == triton.next_power_of_2(E)
    experts = torch.empty(N, top_k, device=logits.device, dtype=torch.int64)
    weights = torch.empty(N, top_k, device=logits.device, dtype=torch.bfloat16)
    _route_kernel[(N,)](logits, experts, weights, E=E, A=top_k, A_PAD=triton.next_power_of_2(top_k),
                        NORM_TOPK=norm_topk_prob, num_warps=4)
    return weights, experts


@triton.jit
def _quarters(t):
    """t[..., 0], t[..., 1], t[..., 2], t[..., 3] of t [..., 4] (elements held by one thread: no data moves)."""
    even, odd = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))        # elements 0, 2 and 1, 3
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def _chain4(a, x, b, y):
    """sum over the last dim (4) of a * x + b * y, as one chain of fused multiply-adds."""
    a0, a1, a2, a3 = _quarters(a)
    x0, x1, x2, x3 = _quarters(x)
    b0, b1, b2, b3 = _quarters(b)
    y0, y1, y2, y3 = _quarters(y)
    s = a0 * x0
    s += b0 * y0
    s += a1 * x1
    s += b1 * y1
    s += a2 * x2
    s += b2 * y2
    s += a3 * x3
    s += b3 * y3
    return s


@triton.jit
def _rows_dot(x_rows, w_rows, s_rows, K: tl.constexpr, NVFP4: tl.constexpr, BLOCK_K: tl.constexpr,
              WAIT: tl.constexpr = 0):
    """acc[i, n] = input row x_rows[i] . weight row w_rows[i, n] over all K (pointer tensors [I, 1] and [I, N]:
    the rows' starts; s_rows: the e4m3 scale rows of NVFP4 weights, whose row scale is left to the caller), fp32.
    K is unrolled, products accumulate elementwise and are reduced once at the end: every weight load of the
    program is issued before its one reduction, so a decode program waits on memory once, not once per expert and
    step. The shapes must be even (BLOCK_K divides K): no masks. WAIT: a PDL wait (_pdl_wait) before the inputs
    are read; the weights are all loaded before it (bf16 in one [rows, K] tile; NVFP4 step by step, in program
    order before any product, the first step also decoded)."""
    if NVFP4:
        # byte j of a row holds elements 2j (low nibble) and 2j + 1 (high), read against one int32 of the input (two
        # bf16). Tiles are [words of 8 codes along K, *rows, their 4 bytes]: threads go along K, so once BLOCK_K / 8
        # covers the program's threads, every thread holds all its rows at the same K, and the input, read in the
        # [H, rows of x, 1, 4] shape of that layout, is loaded once for all the weight rows that share it (sm_90
        # code from triton 3.6 with the launch's 16-byte alignment: each word one 32-bit load, the input 16 bytes at
        # a time, no barrier). One e4m3 scale per 16 elements: each word's 8 products summed in one chain of FMAs,
        # scaled, summed over K at the end (x 2^14 undoes _e2m1's scaling)
        H: tl.constexpr = BLOCK_K // 8
        hh = tl.arange(0, H)
        jj = hh[:, None, None, None] * 4 + tl.arange(0, 4)[None, None, None, :]             # [H, 1, 1, 4]
        acc = tl.zeros([H, w_rows.shape[0], w_rows.shape[1]], dtype=tl.float32)
        codes, scales = (), ()                            # every step's loads first, in program order: one wait
        for k0 in tl.static_range(0, K, BLOCK_K):         # on memory (and before the PDL wait)
            codes = codes + (tl.load(w_rows[None, :, :, None] + k0 // 2 + jj),)
            scales = scales + (tl.load(s_rows[None, :, :] + k0 // 16 + hh[:, None, None] // 2),)
        w_lo, w_hi = _e2m1_pair(codes[0])
        _pdl_wait(WAIT)                                               # (after the weights' loads, step 0 decoded)
        for i in tl.static_range(K // BLOCK_K):
            if i > 0:
                w_lo, w_hi = _e2m1_pair(codes[i])
            x_even, x_odd = _pairs(x_rows[None, :, :, None], i * (BLOCK_K // 2) + jj)
            acc += _chain4(w_lo, x_even, w_hi, x_odd) * scales[i].to(tl.float32)
        return tl.sum(acc, 0) * 16384.0
    if WAIT > 0:
        offs = tl.arange(0, K)[None, None, :]
        w = tl.load(w_rows[:, :, None] + offs)
        _pdl_wait(WAIT)
        return tl.sum(w.to(tl.float32) * tl.load(x_rows[:, :, None] + offs).to(tl.float32), 2)
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    acc = tl.zeros([w_rows.shape[0], w_rows.shape[1], BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        acc += tl.load(w_rows[:, :, None] + k0 + offs_k).to(tl.float32) * \
            tl.load(x_rows[:, :, None] + k0 + offs_k).to(tl.float32)
    return tl.sum(acc, 2)


@triton.jit
def _moe_gate_up_kernel(
    # pointers
    h_ptr, logits_ptr, w_ptr, s_ptr, rs_ptr, sw_ptr, ss_ptr, srs_ptr, act_ptr, ids_ptr, wts_ptr,
    # meta-parameters
    I: tl.constexpr, S_W: tl.constexpr, C: tl.constexpr, E: tl.constexpr, A: tl.constexpr, A_PAD: tl.constexpr,
    NORM_TOPK: tl.constexpr, NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """Program (pid, token b): the shared expert's S_W / BLOCK_N row blocks, then I / BLOCK_N for each of the
    token's A routed experts (slot j < A: its j-th; slot A: the shared one), with no empty programs. Each takes one
    [2, BLOCK_N] block of rows (gate rows n, up rows N + n). The shared expert's programs come first: they need no
    routing (both measured in the note before moe_experts). With one row (PDL 2) the shared expert's programs load
    their weights before the PDL wait, while the router still runs, and the routed ones let the down kernel launch
    only after their wait: it routes the token itself from the router's logits, which are then written
    (_moe_down_kernel). Otherwise one program records the routing for it."""
    pid, b = tl.program_id(0), tl.program_id(1)
    EARLY: tl.constexpr = PDL == 2
    if not EARLY:
        _pdl_wait(PDL)                                                # (the experts follow from the logits)
    shared_blocks = S_W // BLOCK_N                                    # (the shared expert's row blocks first)
    shared = pid < shared_blocks
    j = tl.where(shared, A, (pid - shared_blocks) // (I // BLOCK_N))
    rb = tl.where(shared, pid, (pid - shared_blocks) % (I // BLOCK_N))
    N = tl.where(shared, S_W, I)                                      # rows of gate (and of up) in this expert
    e = tl.full([], 0, tl.int64)
    if j < A:                                                         # (the shared expert's loads need no routing)
        if EARLY:
            _pdl_wait(1)                                              # (wait, then let the down kernel launch)
        elif (rb == 0) & (j == 0):                                    # one program records the routing
            ids, wts = _route(logits_ptr, b, E, A, A_PAD, NORM_TOPK)
            offs_a = tl.arange(0, A_PAD)
            tl.store(ids_ptr + b * A + offs_a, ids, mask=offs_a < A)
            tl.store(wts_ptr + b * A + offs_a, wts, mask=offs_a < A)
        e = _ranked(logits_ptr, b, j, E).to(tl.int64)                 # (slot j needs j + 1 picks)
    ROW_BYTES: tl.constexpr = C // 2 if NVFP4 else C
    rows = e * 2 * I + tl.arange(0, 2)[:, None] * N + rb * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    w_rows = tl.where(shared, sw_ptr, w_ptr) + rows * ROW_BYTES
    s_rows = tl.where(shared, ss_ptr, s_ptr) + rows * (C // 16)
    x_rows = h_ptr + b * C + tl.zeros([1, 1], dtype=tl.int64)
    row_scale = tl.load(tl.where(shared, srs_ptr, rs_ptr) + rows) if NVFP4 else 1.0   # (loads first: one wait)
    acc = _rows_dot(x_rows, w_rows, s_rows, C, NVFP4, BLOCK_K, PDL if EARLY else 0) * row_scale
    is_gate = tl.arange(0, 2)[:, None] == 0
    g = tl.sum(tl.where(is_gate, acc, 0.0), 0)
    u = tl.sum(tl.where(is_gate, 0.0, acc), 0)
    # routed experts keep fp32 accumulators; the shared expert's gate/up outputs are bf16 (spec §2.5.5, §2.4)
    g = tl.where(shared, _round_bf16(g), g)
    u = tl.where(shared, _round_bf16(u), u)
    act = g / (1.0 + tl.exp(-g)) * u
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + (b * (A + 1) + j) * tl.maximum(I, S_W) + offs_n, _to_bf16(act))


@triton.jit
def _moe_down_kernel(
    # pointers
    act_ptr, logits_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, rs_ptr, sw_ptr, ss_ptr, srs_ptr, out_ptr,
    # sizes
    C, S_W,
    # meta-parameters
    I: tl.constexpr, E: tl.constexpr, A: tl.constexpr, J: tl.constexpr, J_PAD: tl.constexpr,
    NORM_TOPK: tl.constexpr, NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row block, token b): out = bf16(bf16(sum_j w_j bf16(down_j act_j)) + bf16(down_s act_s)). Slots
    j < A are the routed experts, slots A .. J - 1 the shared expert's columns in chunks of I: all J weight tiles
    are loaded at once (one wait on memory), the shared chunks' fp32 sums added before its one rounding. The
    experts come from the gate/up kernel's record, or with one row (PDL 2) from routing the token here, before the
    PDL wait, so that the weight loads go first: the router finished before this kernel launched."""
    rb, b = tl.program_id(0), tl.program_id(1)
    EARLY: tl.constexpr = PDL == 2
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, J_PAD)
    routed = offs_j < A
    if EARLY:
        e, w = _route(logits_ptr, b, E, A, J_PAD, NORM_TOPK)
    else:
        _pdl_wait(PDL)                                                # (the experts come from the gate/up kernel)
        e = tl.load(ids_ptr + b * A + offs_j, mask=routed, other=0)
    e = e.to(tl.int64)
    chunk = tl.where(routed, 0, tl.minimum(offs_j, J - 1) - A)        # shared chunk (padding slots: the last,
    real = (offs_j < J)[:, None]                                      # weighted 0)
    ROW_BYTES: tl.constexpr = I // 2 if NVFP4 else I
    rows = tl.where(routed[:, None], e[:, None] * C + offs_n[None, :], offs_n[None, :])
    w_rows = tl.where(routed[:, None], w_ptr + rows * ROW_BYTES,
                      sw_ptr + rows * (S_W // I * ROW_BYTES) + chunk[:, None] * ROW_BYTES)
    s_rows = tl.where(routed[:, None], s_ptr + rows * (I // 16),
                      ss_ptr + rows * (S_W // 16) + chunk[:, None] * (I // 16))
    x_rows = act_ptr + (b * (A + 1) + tl.minimum(offs_j, A)[:, None]) * tl.maximum(I, S_W) + chunk[:, None] * I
    row_scale = tl.load(tl.where(routed[:, None], rs_ptr, srs_ptr) + rows) if NVFP4 else 1.0
    if not EARLY:
        w = tl.load(wts_ptr + b * A + offs_j, mask=routed, other=0.0)    # (loads first: one wait)
    y = _rows_dot(x_rows, w_rows, s_rows, I, NVFP4, BLOCK_K, PDL if EARLY else 0) * row_scale
    routed_sum = tl.sum(tl.where(routed[:, None], w[:, None] * _round_bf16(y), 0.0), 0)   # y_e is bf16
    shared_sum = tl.sum(tl.where(routed[:, None] | ~real, 0.0, y), 0)
    out = _round_bf16(routed_sum) + _round_bf16(shared_sum)
    tl.store(out_ptr + b * C + offs_n, _to_bf16(out))


# The gate/up grid's shared-expert programs go first (they need no routing, so they read weights while
# the routed ones still route). H200, 2026-12-04, us per layer at batch 1 over 8 layers (.dev/sweep.py): bf16 18.92 /
# 19.01 against 19.23 / 19.29 (NVFP4 without PDL 15.69 / 15.70 against 14.95 / 14.99). bf16 whole steps at 512
# (.dev/sf_ab.py, 3 alternated runs, tok/s): batch 2 618.2-620.6 against 615.7-617.5, batch 4 828.0-836.3 against
# 827.8-830.0, batch 8 1008.5-1019.4 against 1009.4-1012.3. NVFP4 with PDL (H100, 2026-12-06, .dev/ab.py, whole steps
# at 4K, two rounds, tok/s): batch 1 624.8-625.9 against 615.9-620.2, batch 4 994.7-994.8 against 969.3-970.2, batch
# 8 1101.5-1109.5 against 1100.0-1100.5; batch 2 706.3-706.5 against 730.4-732.6.
# The grid has exactly the programs that work: a grid of max(I, S_W) / BLOCK_N row blocks per slot left the routed
# slots' blocks past I / BLOCK_N empty, 7168 programs for NVFP4 at batch 1, more than an SM holds at once (32 each),
# so the last ones started only when the first had finished. Whole NVFP4 steps at batch 1 (H100, 2026-12-06,
# .dev/ab2.py, tok/s, the same logits): at 4K 660.2 / 653.4 / 653.2 -> 672.6 / 673.5 / 672.8, at 512 679.9 / 669.0 ->
# 697.1 / 691.1. bench.py at 4K, two rounds: NVFP4 batch 2 727.9 / 725.8 -> 761.1 / 761.6, batch 4 978.0 / 972.6 ->
# 968.4 / 970.0, batch 8 1119.6 / 1118.7 -> 1099.9 / 1109.0 (again: 1106.7 / 1107.1 -> 1097.8 / 1097.5, 0.8% slower);
# bf16 batch 1 (ab2.py) 431.2 / 428.7 / 428.4 -> 431.4 / 429.3 / 429.3, batches 2-8 within 0.3%.
# I and S_W are constexpr, so the grid's division by I / BLOCK_N is a shift, not a software division (sm_90 code of
# the one-row NVFP4 kernel 936 -> 904 instructions). H100, 2026-12-06, .dev/ab2.py, whole NVFP4 steps at 4K, tok/s,
# the same logits: batch 2 767.6 / 772.8 -> 775.1 / 778.4, batch 8 1102.5 / 1103.4 -> 1111.0 / 1113.7; batch 1
# (where it ran before the PDL wait) 672.7 / 671.2 / 671.8 -> 673.1 / 671.9 / 672.0; bf16 batch 1 unchanged.


def moe_experts(h, logits, gate_up, down, shared_gate_up, shared_down, top_k, norm_topk_prob):
    """h [B, C] bf16, router logits [B, E] bf16 -> routed experts + shared expert [B, C] bf16."""
    B, C = h.shape
    E = logits.shape[1]
    I, S_W = down.shape[-1], shared_down.shape[-1]
    assert h.is_contiguous() and logits.is_contiguous() and h.dtype == torch.bfloat16
    assert E == triton.next_power_of_2(E), f"the routing kernel needs a power-of-two expert count, got {E}"
    wp, sp, rsp, nvfp4 = _weight_args(gate_up)
    swp, ssp, srsp, s_nvfp4 = _weight_args(shared_gate_up)
    dwp, dsp, drsp, d_nvfp4 = _weight_args(down)
    sdwp, sdsp, sdrsp, sd_nvfp4 = _weight_args(shared_down)
    assert nvfp4 == s_nvfp4 == d_nvfp4 == sd_nvfp4, "routed and shared experts must share one weight format"
    rows, pdl = _block_b(B), _pdl(h)
    BLOCK_N, BLOCK_K, warps = tiles("moe_gate_up", rows, nvfp4, C)
    assert C % BLOCK_K == 0 and I % BLOCK_N == 0 and S_W % BLOCK_N == 0 and S_W % I == 0 and I % 16 == 0, \
        f"the decode MoE kernels need even shapes: hidden {C}, expert width {I}, shared width {S_W}"
    act = torch.empty(B, top_k + 1, max(I, S_W), device=h.device, dtype=torch.bfloat16)
    ids = torch.empty(B, top_k, device=h.device, dtype=torch.int32)
    wts = torch.empty(B, top_k, device=h.device, dtype=torch.float32)
    _moe_gate_up_kernel[(S_W // BLOCK_N + top_k * (I // BLOCK_N), B)](
        h, logits, wp, sp, rsp, swp, ssp, srsp, act, ids, wts,
        I=I, S_W=S_W, C=C, E=E, A=top_k, A_PAD=triton.next_power_of_2(top_k), NORM_TOPK=norm_topk_prob,
        NVFP4=nvfp4, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PDL=pdl, num_warps=warps, launch_pdl=pdl > 0)
    out = torch.empty_like(h)
    BLOCK_N, BLOCK_K, warps = tiles("moe_down", rows, nvfp4, I)
    assert C % BLOCK_N == 0 and I % BLOCK_K == 0, f"hidden size {C} or expert width {I} is not a multiple of the tile"
    J = top_k + S_W // I
    _moe_down_kernel[(C // BLOCK_N, B)](
        act, logits, ids, wts, dwp, dsp, drsp, sdwp, sdsp, sdrsp, out,
        C, S_W,
        I=I, E=E, A=top_k, J=J, J_PAD=triton.next_power_of_2(J), NORM_TOPK=norm_topk_prob, NVFP4=nvfp4,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PDL=pdl, num_warps=warps, launch_pdl=pdl > 0)
    return out


# -----------------------------------------------------------------------------
# greedy_next: the argmax of the logits, written as the next decode step's input


INT64_MIN = -2**63
_INT64_MIN = tl.constexpr(INT64_MIN)
_GREEDY_STATE = {}      # device -> (best, count) per row, as _greedy_kernel leaves them: INT64_MIN, 0 (shared: one
                        # launch at a time per device, as the decode steps of one stream run). It has rows for
                        # flint.MAX_DECODE_BATCH (64) from the start: no captured decode step sees it replaced
GREEDY_BLOCK = 64 if INTERPRET else 2048


@triton.jit
def _greedy_kernel(logits_ptr, ids_ptr, pos_ptr, best_ptr, count_ptr, n, stride_l,
                   PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, block p of BLOCK logits): the block's largest logit and its first index, packed into an
    int64 that orders like (value, then the lower index first), max-ed into best[b]. The row's last program to
    finish (its ticket from count[b]) takes the row's pick, leaves best[b] and count[b] as the launch found them,
    and writes ids[b] = pick, pos[b] += 1."""
    b, p = tl.program_id(0), tl.program_id(1)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    _pdl_wait(PDL)
    x = tl.load(logits_ptr + b * stride_l + offs, mask=offs < n, other=float("-inf"))
    m, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    bits = tl.where(m == 0.0, 0.0, m).to(tl.int32, bitcast=True)      # (-0 taken as +0)
    key = _ordered(bits, 0x7FFFFFFF).to(tl.int64)
    tl.atomic_max(best_ptr + b, (key << 32) | (0xFFFFFFFF - (p * BLOCK + i).to(tl.int64)), sem="relaxed")
    if tl.atomic_add(count_ptr + b, 1, sem="acq_rel") == PROGRAMS - 1:  # (after every max of the row)
        best = tl.atomic_xchg(best_ptr + b, _INT64_MIN, sem="relaxed")
        tl.store(count_ptr + b, 0)
        tl.store(ids_ptr + b, 0xFFFFFFFF - (best & 0xFFFFFFFF))
        tl.store(pos_ptr + b, tl.load(pos_ptr + b) + 1)


def greedy_next(logits, n, ids, pos):
    """fp32 logits [B, V]: ids [B, 1] = the argmax of each row's first n logits (the first on ties), pos [B, 1]
    += 1, as greedy_next_ref, in one launch. Returns ids [B]."""
    B, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and 0 < n <= V
    assert ids.shape == pos.shape == (B, 1) and ids.dtype == pos.dtype == torch.int64
    assert ids.is_contiguous() and pos.is_contiguous()
    state = _GREEDY_STATE.get(logits.device)
    if state is None or state[0].numel() < B:
        assert not (logits.is_cuda and torch.cuda.is_current_stream_capturing()), \
            "greedy_next: run it once before capturing it in a CUDA graph"
        rows, dev = max(B, 64), logits.device
        state = _GREEDY_STATE[dev] = (torch.full((rows,), INT64_MIN, dtype=torch.int64, device=dev),
                                      torch.zeros(rows, dtype=torch.int32, device=dev))
    pdl = _pdl(logits)
    programs = triton.cdiv(n, GREEDY_BLOCK)
    _greedy_kernel[(B, programs)](logits, ids, pos, *state, n, logits.stride(0), PROGRAMS=programs,
                                  BLOCK=GREEDY_BLOCK, PDL=pdl, num_warps=4, launch_pdl=pdl > 0)
    return ids[:, 0]


# -----------------------------------------------------------------------------
# Prompt chunks: the routed experts as grouped GEMMs over tokens sorted by expert, and a GEMM for NVFP4 weights


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_n, k0, K, NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of weight rows offs_n, bf16 [BLOCK_N, BLOCK_K]: NVFP4 dequantized here, in the
    GEMM main loop (codes e2m1 x e4m3 scale are exact in bf16; the row scale goes on the accumulator)."""
    if NVFP4:
        byte = tl.load(w_ptr + offs_n[:, None] * (K // 2) + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :])
        sc = tl.load(s_ptr + offs_n[:, None] * (K // 16) + k0 // 16 + tl.arange(0, BLOCK_K // 16)[None, :])
        w = tl.join(*_e2m1_pair(byte))                                  # [BLOCK_N, BLOCK_K / 2, 2]: 2j, 2j + 1
        w = tl.reshape(w, [BLOCK_N, BLOCK_K // 16, 16]) * (sc.to(tl.float32) * 16384.0)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(tl.bfloat16)
    else:
        w = tl.load(w_ptr + offs_n[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :])
    return w


@triton.jit
def _grouped_block(blk_expert_ptr, blk_start_ptr, blk_end_ptr, blk, BLOCK_M: tl.constexpr):
    """Expert, sorted rows [BLOCK_M] and end of block blk (expert -1: a spare block, nothing to do)."""
    e = tl.load(blk_expert_ptr + blk)
    start, end = tl.load(blk_start_ptr + blk), tl.load(blk_end_ptr + blk)
    return e, start + tl.arange(0, BLOCK_M), end


@triton.jit
def _grouped_gate_up_kernel(
    # pointers
    x_ptr, order_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr, w_ptr, s_ptr, rs_ptr, act_ptr,
    # sizes
    C, I, A: tl.constexpr,
    # meta-parameters
    NVFP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (block, column block): act = bf16(silu(g) * u) of up to BLOCK_M sorted (token, slot) rows routed
    to one expert, their x rows gathered in the main loop; g, u stay fp32 accumulators."""
    expert, rows, end = _grouped_block(blk_expert_ptr, blk_start_ptr, blk_end_ptr, tl.program_id(0), BLOCK_M)
    if expert >= 0:
        e = expert.to(tl.int64)
        tok = tl.load(order_ptr + rows, mask=rows < end, other=0).to(tl.int64) // A  # past the end: row 0
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_bytes, row_scales = (C // 2, C // 16) if NVFP4 else (C, C)
        wg, sg = w_ptr + e * (2 * I) * row_bytes, s_ptr + e * (2 * I) * row_scales
        wu, su = wg + I * row_bytes, sg + I * row_scales
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, C, BLOCK_K):
            x = tl.load(x_ptr + tok[:, None] * C + k0 + offs_k[None, :])
            g = _dot(g, x, _weight_tile(wg, sg, offs_n, k0, C, NVFP4, BLOCK_N, BLOCK_K))
            u = _dot(u, x, _weight_tile(wu, su, offs_n, k0, C, NVFP4, BLOCK_N, BLOCK_K))
        if NVFP4:
            g *= tl.load(rs_ptr + e * (2 * I) + offs_n)[None, :]
            u *= tl.load(rs_ptr + e * (2 * I) + I + offs_n)[None, :]
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + rows[:, None] * I + offs_n[None, :], _to_bf16(act), mask=(rows < end)[:, None])


@triton.jit
def _grouped_down_kernel(
    # pointers
    act_ptr, dst_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr, w_ptr, s_ptr, rs_ptr, y_ptr,
    # sizes
    C, I,
    # meta-parameters
    NVFP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (block, column block): y_e = bf16(down_e act) of the block's sorted rows, stored at their
    (token, slot) row dst."""
    expert, rows, end = _grouped_block(blk_expert_ptr, blk_start_ptr, blk_end_ptr, tl.program_id(0), BLOCK_M)
    if expert >= 0:
        e = expert.to(tl.int64)
        src = tl.where(rows < end, rows, end - 1).to(tl.int64)          # past the end: the block's last row
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_bytes, row_scales = (I // 2, I // 16) if NVFP4 else (I, I)
        wd, sd = w_ptr + e * C * row_bytes, s_ptr + e * C * row_scales
        y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            a = tl.load(act_ptr + src[:, None] * I + k0 + offs_k[None, :])
            y = _dot(y, a, _weight_tile(wd, sd, offs_n, k0, I, NVFP4, BLOCK_N, BLOCK_K))
        if NVFP4:
            y *= tl.load(rs_ptr + e * C + offs_n)[None, :]
        dst = tl.load(dst_ptr + rows, mask=rows < end, other=0).to(tl.int64)
        tl.store(y_ptr + dst[:, None] * C + offs_n[None, :], _to_bf16(y), mask=(rows < end)[:, None])


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, s_ptr, rs_ptr, y_ptr, M, N, K,
                   NVFP4: tl.constexpr, OUT_F32: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, column block): y = x @ W^T, W bf16 or NVFP4 (dequantized in the main loop)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    src = tl.minimum(rows, M - 1).to(tl.int64)                        # past the end: the last row
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.minimum(offs_n, N - 1)                                  # past the end: the last weight row
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + src[:, None] * K + k0 + offs_k[None, :])
        acc = _dot(acc, x, _weight_tile(w_ptr, s_ptr, cols, k0, K, NVFP4, BLOCK_N, BLOCK_K))
    if NVFP4:
        acc *= tl.load(rs_ptr + cols)[None, :]
    y = acc if OUT_F32 else _to_bf16(acc)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], y,
             mask=(rows < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, C, A: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (column block, token t): out[t] = bf16(sum_a w[t, a] * y[t, a]) summed in fp32."""
    offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for a in range(A):
        acc += tl.load(w_ptr + t * A + a).to(tl.float32) * _load_f32(y_ptr + (t * A + a) * C + offs, offs < C)
    tl.store(out_ptr + t * C + offs, _to_bf16(acc), mask=offs < C)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the prompt-chunk GEMMs, for bf16 and NVFP4 weights; measured
# on an H200 at Flint's shapes (.dev/tune_prefill.py). BLOCK_M is halved when experts get few rows each; the down
# GEMM runs over the gate/up GEMM's blocks, so its BLOCK_M is that one's.
GEMM_TILES = {
    ("matmul", False): (64, 256, 64, 4, 4),
    ("matmul", True): (128, 128, 64, 8, 4),
    ("gate_up", False): (128, 128, 64, 8, 3),
    ("gate_up", True): (128, 128, 64, 8, 3),
    ("down", False): (128, 128, 64, 4, 3),
    ("down", True): (128, 64, 64, 4, 3),
}


def _gemm_tiles(kernel, nvfp4, rows, N, K):
    """Tiles for a GEMM of `rows` rows (per expert) by an [N, K] weight: BLOCK_M halved while it is over twice the
    rows, BLOCK_K halved until it divides K (the main loop does not mask), BLOCK_N (grouped GEMMs) until it
    divides N."""
    BLOCK_M, BLOCK_N, BLOCK_K, warps, stages = GEMM_TILES[kernel, nvfp4]
    if INTERPRET:                                                     # small tiles, several blocks per test
        BLOCK_M, BLOCK_N, BLOCK_K, warps, stages = (32, 64, 64, 4, 1) if kernel == "matmul" else (16, 32, 32, 4, 1)
    while BLOCK_M > 16 and rows < BLOCK_M // 2:
        BLOCK_M //= 2
    while kernel != "matmul" and N % BLOCK_N:
        BLOCK_N //= 2
    while K % BLOCK_K:
        BLOCK_K //= 2
    assert BLOCK_N >= 16 and BLOCK_K >= 16, f"the GEMM tiles need N and K divisible by 16, got {N}x{K}"
    return BLOCK_M, BLOCK_N, BLOCK_K, warps, stages


@triton.jit
def _expert_blocks_kernel(flat_ptr, order_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr, R, n_blocks,
                          E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Program e: the rows routed to expert e (flat [R]) go to order[before + rank] in row order (before: rows of
    experts < e), and its blocks of BLOCK_M rows to slots e + before // BLOCK_M + j; the slots up to the next
    expert's first one are spare (expert -1). (Expert e's cdiv(count, BLOCK_M) slots end at or before
    e + 1 + (before + count) // BLOCK_M, where expert e + 1's begin, and the last one's before n_blocks.)"""
    e = tl.program_id(0)
    before, count = 0, 0
    for r0 in range(0, R, BLOCK):
        ex = tl.load(flat_ptr + r0 + tl.arange(0, BLOCK), mask=r0 + tl.arange(0, BLOCK) < R, other=E)
        before += tl.sum((ex < e).to(tl.int32), 0)
        count += tl.sum((ex == e).to(tl.int32), 0)
    seen = 0
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        hit = tl.load(flat_ptr + r, mask=r < R, other=E) == e
        rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(order_ptr + before + rank, r, mask=hit)
        seen += tl.sum(hit.to(tl.int32), 0)
    first = e + before // BLOCK_M
    mine = first + tl.cdiv(count, BLOCK_M)
    nxt = tl.where(e == E - 1, n_blocks, e + 1 + (before + count) // BLOCK_M)
    for j0 in range(first, nxt, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(blk_expert_ptr + j, tl.where(j < mine, e, -1), mask=j < nxt)
        tl.store(blk_start_ptr + j, before + (j - first) * BLOCK_M, mask=j < nxt)
        tl.store(blk_end_ptr + j, before + count, mask=j < nxt)


def _expert_blocks(flat, E, BLOCK_M):
    """Sort the (token, slot) rows by expert (stable) and cut them into blocks of one expert and at most BLOCK_M
    rows, in one launch without a host sync: at most rows / BLOCK_M + E blocks, the spare ones of expert -1.
    Returns int32 (order: the sorted rows' (token, slot) index, block expert, start, end)."""
    R = flat.numel()
    n_blocks = triton.cdiv(R, BLOCK_M) + E
    order = torch.empty(R, device=flat.device, dtype=torch.int32)
    blk_expert, blk_start, blk_end = torch.empty(3, n_blocks, device=flat.device, dtype=torch.int32)
    _expert_blocks_kernel[(E,)](flat, order, blk_expert, blk_start, blk_end, R, n_blocks, E=E, BLOCK_M=BLOCK_M,
                                BLOCK=min(1024, triton.next_power_of_2(max(R, BLOCK_M))), num_warps=4)
    return order, blk_expert, blk_start, blk_end


def experts(x, weights, experts, gate_up, down):
    """Routed experts of many tokens: x [N, C] bf16, weights/experts [N, A] -> [N, C] bf16 (see experts_ref).
    The N * A (token, slot) rows are sorted by expert and cut into blocks of one expert each, so every expert's
    weights are read once per block of up to BLOCK_M rows; experts no token chose are not read. Three launches
    (gate/up + SwiGLU, down, weighted combine) and no host sync."""
    N, C = x.shape
    A = experts.shape[1]
    E, I = down.shape[0], down.shape[-1]
    assert x.is_contiguous() and x.dtype == torch.bfloat16
    wp, sp, rsp, nvfp4 = _weight_args(gate_up)
    dwp, dsp, drsp, d_nvfp4 = _weight_args(down)
    assert nvfp4 == d_nvfp4, "gate_up and down must share one weight format"
    rows_per_expert = N * A / E
    BM, BN, BK, warps, stages = _gemm_tiles("gate_up", nvfp4, rows_per_expert, I, C)
    order, blk_expert, blk_start, blk_end = _expert_blocks(experts.flatten(), E, BM)
    act = torch.empty(N * A, I, device=x.device, dtype=torch.bfloat16)
    _grouped_gate_up_kernel[(blk_expert.numel(), I // BN)](
        x, order, blk_expert, blk_start, blk_end, wp, sp, rsp, act, C, I, A=A,
        NVFP4=nvfp4, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages)
    _, BN, BK, warps, stages = _gemm_tiles("down", nvfp4, rows_per_expert, C, I)  # the same blocks of BM rows
    y = torch.empty(N * A, C, device=x.device, dtype=torch.bfloat16)  # (token, slot) order
    _grouped_down_kernel[(blk_expert.numel(), C // BN)](
        act, order, blk_expert, blk_start, blk_end, dwp, dsp, drsp, y, C, I,
        NVFP4=nvfp4, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages)
    out = torch.empty_like(x)
    BLOCK_C = min(1024, triton.next_power_of_2(C))
    _combine_kernel[(triton.cdiv(C, BLOCK_C), N)](y, weights.contiguous(), out, C, A=A, BLOCK_C=BLOCK_C, num_warps=4)
    return out


def matmul(x, w, f32=False):
    """x [M, K] bf16 (any M) @ w^T for a bf16 or NVFP4 weight [N, K] -> [M, N] bf16 (fp32 if f32): the prefill
    GEMMs of NVFP4 weights (see linear_ref / linear_f32)."""
    M, K = x.shape
    wp, sp, rsp, nvfp4 = _weight_args(w)
    N = w.shape[0]
    assert w.shape[-1] == K and x.is_contiguous() and x.dtype == torch.bfloat16
    BM, BN, BK, warps, stages = _gemm_tiles("matmul", nvfp4, M, N, K)
    y = torch.empty(M, N, device=x.device, dtype=torch.float32 if f32 else torch.bfloat16)
    _matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x, wp, sp, rsp, y, M, N, K, NVFP4=nvfp4, OUT_F32=f32,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages)
    return y
