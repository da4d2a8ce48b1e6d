"""Flint (RecursiveSI/flint), the whole model in plain PyTorch, readable top to bottom.

Flint is a 39.8B-parameter mixture-of-experts decoder with 2.5B parameters active per token: 49 layers of
attention with learned per-head sinks, hybrid sliding-window (513 keys) and full attention (full layers use no
RoPE), a dense SwiGLU MLP on the first two layers and 256 sigmoid-routed experts (top-6) plus an ungated shared
expert on the others. The numbers, and every rounding rule below, come from ../shared/flint-spec.md (cited as §n);
the config keys are those of the HF `config.json` (transformers `FlintConfig`).

Numerics follow the spec's "serving reference" (§2.8): bf16 weights and activations, fp32 norm statistics,
softmax, sinks, router scores and lm_head. In float32 every rounding to the model dtype is a no-op, which is how
the tests compare this file with HF transformers to 1e-4.

Each op has a plain-torch reference (`*_ref`), the spec of the Triton kernels in kernels.py, which slot in beside
it with the same signature.

Shape legend: B batch, T new tokens, S cache slots, H query heads (32), G kv heads (4), D head dim (128),
C hidden (2048), F dense MLP width (6144), E experts (256), A active experts per token (6), I expert width (512),
V vocab (150144), N = B*T flattened tokens.
"""
import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

# The reference GEMMs accumulate in fp32 and round once (spec §2): cuBLAS may otherwise reduce bf16 split-K partials
# in bf16, which moves router logits by an ulp and flips near-tied expert choices against the kernels.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """The keys of Flint's config.json, with the published defaults (§1). Validated in __post_init__."""
    vocab_size: int = 150144
    hidden_size: int = 2048
    intermediate_size: int = 6144            # dense MLP width (layers in mlp_only_layers)
    num_hidden_layers: int = 49
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128                      # never hidden_size // num_attention_heads (= 64)
    moe_intermediate_size: int = 512         # width of one routed expert
    shared_expert_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_tok: int = 6
    norm_topk_prob: bool = True              # renormalize the top-k sigmoid scores to sum to one
    mlp_only_layers: list = field(default_factory=lambda: [0, 1])
    decoder_sparse_step: int = 1             # layer i is MoE iff i not in mlp_only_layers and (i+1) % step == 0
    layer_types: list | None = None          # "sliding_attention" | "full_attention" per layer
    no_rope_layer_indices: list | None = None  # absent in transformers-saved configs: the full layers
    sliding_window: int = 513                # keys visible on sliding layers, current token included
    rope_parameters: dict | None = None      # transformers 5.x: {"rope_type": "default", "rope_theta": ...}
    rope_theta: float | None = None          # older configs; resolved from rope_parameters when absent
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144

    def __post_init__(self):
        L = self.num_hidden_layers
        if self.layer_types is None:  # HF rule: full on the first two layers, every fourth from 1, and the last
            self.layer_types = ["full_attention" if i < 2 or i % 4 == 1 or i == L - 1 else "sliding_attention"
                                for i in range(L)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != L or set(self.layer_types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"config: layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                             f"{L} layers, found {self.layer_types}")
        full = [i for i, t in enumerate(self.layer_types) if t == "full_attention"]
        if self.no_rope_layer_indices is None:
            self.no_rope_layer_indices = full
        if sorted(self.no_rope_layer_indices) != full:
            raise ValueError(f"config: no_rope_layer_indices {self.no_rope_layer_indices} differ from the "
                             f"full-attention layers {full}; Flint rotates exactly the sliding layers")
        # RoPE: only the default type; theta is read from the checkpoint, never assumed (§1)
        rp = self.rope_parameters or {}
        if rp.get("rope_type", "default") != "default" or set(rp) - {"rope_type", "rope_theta"}:
            raise ValueError(f"config: rope_parameters {rp} is not supported; Flint uses rope_type 'default' with "
                             f"no scaling")
        theta = rp.get("rope_theta", self.rope_theta)
        if theta is None:
            raise ValueError("config: no rope_theta in rope_parameters or at the top level; add the checkpoint's "
                             "value to config.json")
        if self.rope_theta is not None and theta != self.rope_theta:
            raise ValueError(f"config: rope_parameters.rope_theta {theta} differs from rope_theta {self.rope_theta}")
        self.rope_theta = float(theta)
        checks = [
            (self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
             f"{self.num_key_value_heads}"),
            (self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE"),
            (0 < self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts {self.num_experts}"),
            (all(0 <= i < L for i in self.mlp_only_layers), f"mlp_only_layers {self.mlp_only_layers} out of range"),
            (self.decoder_sparse_step >= 1, f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1"),
            (self.sliding_window >= 1, f"sliding_window {self.sliding_window} must be >= 1"),
            (not self.tie_word_embeddings, "tie_word_embeddings is true, but Flint's lm_head is untied"),
            (min(self.vocab_size, self.hidden_size, L, self.max_position_embeddings) > 0, "sizes must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"config: {msg}")

    def is_moe(self, i):
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def is_sliding(self, i):
        return self.layer_types[i] == "sliding_attention"


# -----------------------------------------------------------------------------
# Reference math: each function is the spec of one kernel


def linear_ref(x, w):
    """y = x @ w^T with fp32 accumulation and one rounding to x's dtype; w is a [N, K] tensor or NVFP4."""
    return linear_f32(x, w).to(x.dtype) if isinstance(w, NVFP4) else F.linear(x, w)


def linear_f32(x, w):
    """y = x @ w^T left as the fp32 accumulator. NVFP4 (W4A16): the weight dequantizes exactly (e2m1 x e4m3 fits
    in bf16) and its global scale multiplies the accumulator, not the weight (spec §4b)."""
    if isinstance(w, NVFP4):
        return F.linear(x.float(), w.dequantize()) * w.row_scale
    return F.linear(x.float(), w.float())


def add_rms_norm_ref(x, dx, w, eps):
    """Residual add + RMSNorm (§2.2): s = f32(x) + f32(dx); returns (bf16(s), bf16(s * rsqrt(mean s^2 + eps) * w)).

    The norm reads the unrounded fp32 sum (serving reference; HF eager adds in bf16 first). dx=None: no add.
    The weight multiplies directly: no (1 + w)."""
    s = x.float() if dx is None else x.float() + dx.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return s.to(x.dtype), y.to(x.dtype)


def rms_norm_ref(x, w, eps):
    return add_rms_norm_ref(x, None, w, eps)[1]


def rope_table(cfg, n, device):
    """fp32 cos, sin [n, D/2] of angle p * inv_freq[i], inv_freq[i] = 1 / theta^(2i/D), computed like HF (§2.3.3)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    ang = torch.arange(n, dtype=torch.float, device=device)[:, None] * inv_freq.to(device)
    return ang.cos(), ang.sin()


def rope_ref(x, cos, sin):
    """NeoX RoPE over all D dims, pairs (i, i + D/2): x [B, T, n, D]; cos, sin [B, T, D/2] at each token's
    absolute position. The rotation is fp32 with one rounding at the end (serving; HF rounds cos/sin to bf16)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope_ref(q, k, q_norm, k_norm, cos, sin, eps):
    """Attention's q [B, T, H, D] and k [B, T, G, D] before the cache (§2.3.2-3): per-head RMSNorm (one weight
    each, shared by the heads), rounded, then on sliding layers RoPE at cos, sin [B, T, D/2] (None: a full layer)."""
    q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    if cos is not None:
        q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    return q, k


def slot_positions(last, S):
    """Position held by each of S cache slots [B, S] once positions up to `last` [B, 1] were written in order to
    slot p % S; negative = never written. (Full layers: S = max length, so slot = position.)"""
    return last - (last - torch.arange(S, device=last.device)) % S


SCORES_BUDGET = 2**28          # attention scores per prefill block (fp32: 1 GiB), whatever the context length


def sink_attention_ref(q, k, v, sinks, q_pos, k_pos, window):
    """Attention with learned sinks over keys identified by their absolute positions (§2.3.4-7).

    q [B, T, H, D]; k, v [B, S, G, D]; sinks [H] fp32; q_pos [B, T]; k_pos [B, S] with -1 for an empty slot;
    window = keys visible including the current one (513), or 0 for full attention. Returns [B, T, H, D].
    Key j is visible to query i iff 0 <= k_pos[j] <= q_pos[i] and q_pos[i] - k_pos[j] < window. The sink is one
    extra logit per head, in the units of the scaled score, that adds to the softmax denominator and attends to
    nothing. Serving numerics: fp32 scores and softmax, unnormalized P rounded to the model dtype for P @ V with an
    fp32 row sum, and the divide last. Queries go in blocks that keep the fp32 scores within SCORES_BUDGET."""
    B, T, H, D = q.shape
    G = k.shape[2]
    n = max(1, SCORES_BUDGET // (B * H * k.shape[1]))                   # queries per block
    if T > n:
        return torch.cat([sink_attention_ref(q[:, i:i + n], k, v, sinks, q_pos[:, i:i + n], k_pos, window)
                          for i in range(0, T, n)], 1)
    qf = q.float().view(B, T, G, H // G, D)                                # query head h reads kv head h // (H/G)
    s = torch.einsum("btgrd,bsgd->bgrts", qf, k.float()) * D ** -0.5     # [B, G, H/G, T, S]
    dist = q_pos[:, :, None] - k_pos[:, None, :]                         # [B, T, S]
    visible = (k_pos[:, None, :] >= 0) & (dist >= 0)
    if window:
        visible &= dist < window
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.float().view(1, G, H // G, 1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)                   # the sink is finite: m is never -inf
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True) + torch.exp(sink - m)                    # [B, G, H/G, T, 1]
    o = torch.einsum("bgrts,bsgd->btgrd", p.to(v.dtype).float(), v.float()) / l.permute(0, 3, 1, 2, 4)
    return o.reshape(B, T, H, D).to(q.dtype)


def swiglu_ref(gate_up):
    """act = silu(g) * u in fp32, one rounding (§2.4); gate_up [..., 2I] with the gate half first."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (g / (1 + torch.exp(-g)) * u).to(gate_up.dtype)


def mlp_ref(x, gate_up, down):
    """Dense SwiGLU MLP (layers 0-1, and the shared expert): down(silu(gate x) * up x). x [N, C]."""
    return linear_ref(swiglu_ref(linear_ref(x, gate_up)), down)


def route_ref(logits, top_k, norm_topk_prob):
    """Sigmoid top-k routing (§2.5.2-4): router logits [N, E] -> weights [N, A] (logits' dtype), experts [N, A].

    Experts are selected on the logits (sigmoid is monotone, and fp32 sigmoid saturates to 1.0, creating false
    ties); ties go to the lowest expert index, which a stable descending sort guarantees and torch.topk does not."""
    r = logits.float()
    experts = torch.sort(r, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [N, A]
    w = torch.sigmoid(r.gather(-1, experts))                            # [N, A] fp32
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w.to(logits.dtype), experts


def experts_ref(x, weights, experts, gate_up, down):
    """Routed experts (§2.5.5-6): x [N, C], weights/experts [N, A], gate_up [E, 2I, C], down [E, C, I] -> [N, C].

    gate/up stay fp32 accumulators, act = bf16(silu(g) * u), y_e = bf16(down_e act); the routing weights apply
    after the down projection, summed in fp32 with one rounding."""
    N, C = x.shape
    out = torch.zeros(N, C, dtype=torch.float, device=x.device)
    for e in experts.unique().tolist():                                  # the oracle: a plain loop over experts
        n, a = (experts == e).nonzero(as_tuple=True)                     # tokens routed to e, and in which slot
        h = linear_f32(x[n], gate_up[e])                                # [n, 2I] fp32 accumulators
        g, u = h.chunk(2, dim=-1)
        act = (g / (1 + torch.exp(-g)) * u).to(x.dtype)
        y = linear_ref(act, down[e])                                     # [n, C]
        out.index_add_(0, n, weights[n, a, None].float() * y.float())
    return out.to(x.dtype)


def moe_experts_ref(h, logits, gate_up, down, shared_gate_up, shared_down, top_k, norm_topk_prob):
    """The MoE block after the router (§2.5): h [N, C], router logits [N, E] (bf16, the router GEMM's output in
    the serving reference; HF computes them in fp32) -> bf16(f32(routed) + f32(shared)) [N, C]."""
    weights, experts = route_ref(logits, top_k, norm_topk_prob)
    routed = experts_ref(h, weights, experts, gate_up, down)
    shared = mlp_ref(h, shared_gate_up, shared_down)
    return (routed.float() + shared.float()).to(h.dtype)


def add_norm_linear_ref(x, dx, norm_w, w, eps, f32=False):
    """Residual add + RMSNorm + linear: (bf16(x + dx), h = rmsnorm(x + dx), h @ w^T). f32 is the lm_head (§2.6):
    bf16 h times the exactly upcast weight, fp32 accumulation and logits (TF32 stays off: torch's default)."""
    x, h = add_rms_norm_ref(x, dx, norm_w, eps)
    return x, h, (linear_f32(h, w) if f32 else linear_ref(h, w))


def add_norm_swiglu_ref(x, dx, norm_w, gate_up, eps):
    """The dense MLP's input half: (bf16(x + dx), silu(h @ gate^T) * (h @ up^T))."""
    x, h = add_rms_norm_ref(x, dx, norm_w, eps)
    return x, swiglu_ref(linear_ref(h, gate_up))


def greedy_next_ref(logits, n, ids, pos):
    """Greedy decoding's last op, which also sets up the next step: ids [B, 1] = the index of the largest of the
    first n fp32 logits [B, V] of each row (the first one on ties, as torch.argmax), pos [B, 1] += 1, in place.
    Returns ids [B]."""
    ids.copy_(logits[:, :n].argmax(-1, keepdim=True))
    pos.add_(1)
    return ids[:, 0]


def attention_decode_ref(qkv, q_norm, k_norm, sinks, cos, sin, k_cache, v_cache, pos, window, eps, w_o):
    """One new token per sequence: qkv [B, (H+2G)D] -> o_proj(o) [B, C] (o [B, H*D] itself if w_o is None). q/k
    RMSNorm per head, RoPE on sliding layers (window > 0; cos/sin are the [n, D/2] tables), store k, v at slot
    pos % S of k/v_cache [B, S, G, D], then attend over the cache, masked by the position each slot holds."""
    B, S, G, D = k_cache.shape
    H = sinks.shape[0]
    q, k, v = qkv.view(B, 1, H + 2 * G, D).split([H, G, G], dim=2)     # [B, 1, n, D]
    q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)   # rounded before RoPE
    if window:
        q, k = rope_ref(q, cos[pos][:, None], sin[pos][:, None]), rope_ref(k, cos[pos][:, None], sin[pos][:, None])
    rows = torch.arange(B, device=pos.device)
    k_cache[rows, pos % S], v_cache[rows, pos % S] = k[:, 0], v[:, 0]
    k_pos = slot_positions(pos[:, None], S)                             # [B, S]
    o = sink_attention_ref(q, k_cache, v_cache, sinks, pos[:, None], k_pos, window).view(B, H * D)
    return o if w_o is None else linear_ref(o, w_o)


# -----------------------------------------------------------------------------
# NVFP4 weights

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value


class NVFP4(nn.Module):
    """A weight [..., N, K] in NVFP4, kept 4-bit: w[n, k] = e2m1(code[n, k]) * e4m3(scales[n, k // 16]), and
    y[n] = row_scale[n] * sum_k x[k] w[n, k] on the fp32 accumulator.

    packed [..., N, K/2] uint8 holds element 2j in the low nibble of byte j and 2j+1 in the high one (ModelOpt's
    layout; load.py repacks GGUF blocks into it losslessly). row_scale is the checkpoint's per-tensor global scale
    repeated over that tensor's rows, so fused q/k/v or gate/up parts and stacked experts each keep their own."""

    def __init__(self, packed, scales, row_scale):
        super().__init__()
        assert packed.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn and row_scale.dtype == torch.float
        assert scales.shape[-1] * 8 == packed.shape[-1] and row_scale.shape == packed.shape[:-1]
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("row_scale", row_scale)

    @classmethod
    def empty(cls, *shape, device=None):
        *lead, N, K = shape
        assert K % 16 == 0, f"NVFP4 needs K divisible by 16, got {K}"
        return cls(torch.empty(*lead, N, K // 2, dtype=torch.uint8, device=device),
                   torch.empty(*lead, N, K // 16, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(*lead, N, dtype=torch.float, device=device))

    @property
    def shape(self):
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    def __getitem__(self, i):                                           # one expert of a stacked weight
        return NVFP4(self.packed[i], self.scales[i], self.row_scale[i])

    def dequantize(self):
        """fp32 [..., N, K] without row_scale; exact."""
        lut = torch.tensor(E2M1, device=self.packed.device)
        codes = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).flatten(-2)  # [..., N, K]
        w = lut[codes.long()].unflatten(-1, (-1, 16)) * self.scales.float()[..., None]
        return w.flatten(-2)


# -----------------------------------------------------------------------------
# Modules: weights are plain tensors (or NVFP4) named after what they hold; load.py fills them


def weight_factory(dtype, device, nvfp4=()):
    """make(name, *shape): an empty weight, NVFP4 if its flint name is in `nvfp4`, else a tensor of `dtype`."""
    def make(name, *shape, dtype=dtype):
        if name in nvfp4:
            return NVFP4.empty(*shape, device=device)
        return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    return make


REFERENCE_OPS = SimpleNamespace(add_norm_linear=add_norm_linear_ref, add_norm_swiglu=add_norm_swiglu_ref,
                                linear=linear_ref, attention_decode=attention_decode_ref, moe_experts=moe_experts_ref,
                                qk_norm_rope=qk_norm_rope_ref, sink_attention=sink_attention_ref,
                                greedy_next=greedy_next_ref)


MAX_DECODE_BATCH = 64  # sequences per decode step (benchmarked and tested up to here)
# From this many rows (sequences of a decode step, tokens of a chunk) weights go through GEMMs: from 9 rows the
# decode GEMVs take 16-row tiles anyway, and GEMMs are faster there (H200, batch 16: bf16 1514.8 tok/s against
# 1170.6, NVFP4 960.3 against 434.9). At most 9: the decode GEMV kernels take up to 8 rows.
GEMM_MIN_ROWS = 9


def by_rows(small, large):
    """small(x, ...) for fewer than GEMM_MIN_ROWS rows of x, else large(x, ...)."""
    return lambda x, *args, **kw: (large if x.shape[0] >= GEMM_MIN_ROWS else small)(x, *args, **kw)


def kernel_ops():
    """The Triton twins of REFERENCE_OPS (same names and signatures), for decode steps of up to MAX_DECODE_BATCH
    sequences. From GEMM_MIN_ROWS sequences up, the ops with weights run as in prompt chunks (prefill_ops): GEMMs
    read each weight tile once for all rows, and the MoE groups its tokens by expert (at batch 64 the 384 (token,
    expert) pairs of a layer touch about 200 distinct experts, each then read once)."""
    import kernels
    gemm = prefill_ops()
    ops = SimpleNamespace(**{name: getattr(kernels, name) for name in vars(REFERENCE_OPS)})
    for name in ("add_norm_swiglu", "linear", "moe_experts"):
        setattr(ops, name, by_rows(getattr(kernels, name), getattr(gemm, name)))
    ops.add_norm_linear = gemm.add_norm_linear                       # (chooses by rows itself)

    def attention_gemm(*args):                                       # o_proj apart, as a GEMM
        return gemm.linear(kernels.attention_decode(*args[:-1], None), args[-1])
    ops.attention_decode = by_rows(kernels.attention_decode, attention_gemm)
    return ops


def prefill_ops():
    """Ops for prompt chunks on the GPU, same names and signatures: the reference ops recomposed from cuBLAS GEMMs
    (bf16 weights), Triton GEMMs (NVFP4 weights, fp32 outputs: dequantized in the main loop), Triton norms and
    routing, Triton flash attention with sinks and the routed experts as grouped GEMMs. Inputs of fewer than
    GEMM_MIN_ROWS rows (the last token's logits, short chunks) take the decode kernels' add_norm_linear."""
    import kernels

    def linear(x, w, f32=False):
        if isinstance(w, NVFP4) or f32:                             # (cuBLAS has no bf16 x bf16 -> fp32 GEMM)
            return kernels.matmul(x, w, f32)
        return F.linear(x, w)

    def add_norm_gemm(x, dx, norm_w, w, eps, f32=False):
        x, h = kernels.add_rms_norm(x, dx, norm_w, eps)
        return x, h, linear(h, w, f32)

    def add_norm_swiglu(x, dx, norm_w, gate_up, eps):
        x, _, gate_up = add_norm_gemm(x, dx, norm_w, gate_up, eps)
        return x, swiglu_ref(gate_up)

    def moe_experts(h, logits, gate_up, down, shared_gate_up, shared_down, top_k, norm_topk_prob):
        weights, experts = kernels.route(logits, top_k, norm_topk_prob)
        routed = kernels.experts(h, weights, experts, gate_up, down)
        shared = linear(swiglu_ref(linear(h, shared_gate_up)), shared_down)
        return routed + shared                                     # (bf16 + bf16: one fp32 add, one rounding)

    return SimpleNamespace(add_norm_linear=by_rows(kernels.add_norm_linear, add_norm_gemm),
                           add_norm_swiglu=add_norm_swiglu, linear=linear,
                           attention_decode=attention_decode_ref, moe_experts=moe_experts,
                           qk_norm_rope=kernels.qk_norm_rope, sink_attention=kernels.sink_attention)


class Attention(nn.Module):
    def __init__(self, cfg, layer, make):
        super().__init__()
        H, G, D, C = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.layer, self.n_heads, self.n_kv_heads, self.head_dim = layer, H, G, D
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else 0  # 0: full attention, no RoPE (NoPE)
        p = f"layers.{layer}.attn."
        self.qkv = make(p + "qkv", (H + 2 * G) * D, C)                   # rows: q heads, then k, then v
        self.o = make(p + "o", C, H * D)
        self.q_norm = make(p + "q_norm", D)                              # shared by all heads (§2.3.2)
        self.k_norm = make(p + "k_norm", D)
        self.sinks = make(p + "sinks", H, dtype=torch.float)             # fp32 logits (self_attn.softmax_offset)

    def forward(self, x, dx, norm_w, pos, cache, rope, ops):
        """x + dx [N, C] -> (bf16(x + dx), o_proj(attention(rmsnorm(x + dx))))."""
        B, T = pos.shape
        x, _, qkv = ops.add_norm_linear(x, dx, norm_w, self.qkv, self.eps)   # [N, (H+2G)D]
        if T == 1 and cache is not None:                                 # decode: one fused op, o_proj included
            return x, ops.attention_decode(qkv, self.q_norm, self.k_norm, self.sinks, *rope, cache.k[self.layer],
                                           cache.v[self.layer], pos[:, 0], self.window, self.eps, self.o)
        return x, ops.linear(self.prefill(qkv, pos, cache, rope, ops), self.o)

    def prefill(self, qkv, pos, cache, rope, ops):
        """T new tokens per sequence: qkv [B*T, (H+2G)D] -> o [B*T, H*D]."""
        B, T = pos.shape
        H, G, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = qkv.view(B, T, H + 2 * G, D).split([H, G, G], dim=2)  # [B, T, n, D]
        cos, sin = (rope[0][pos], rope[1][pos]) if self.window else (None, None)  # [B, T, D/2]
        q, k = ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, cos, sin, self.eps)
        if cache is None:                                                # attend within the new tokens
            ks, vs, k_pos = k, v, pos
        else:
            ks, vs, k_pos = cache.store(self.layer, k, v, pos)
        o = ops.sink_attention(q.contiguous(), ks, vs, self.sinks, pos, k_pos, self.window)  # [B, T, H, D]
        return o.reshape(B * T, H * D)


class MLP(nn.Module):
    """Dense SwiGLU (mlp_only_layers)."""

    def __init__(self, cfg, layer, make):
        super().__init__()
        F_, C, p = cfg.intermediate_size, cfg.hidden_size, f"layers.{layer}.ffn."
        self.eps = cfg.rms_norm_eps
        self.gate_up = make(p + "gate_up", 2 * F_, C)                    # rows: gate, then up
        self.down = make(p + "down", C, F_)

    def forward(self, x, dx, norm_w, ops):
        x, act = ops.add_norm_swiglu(x, dx, norm_w, self.gate_up, self.eps)
        return x, ops.linear(act, self.down)


class MoE(nn.Module):
    """256 sigmoid-routed SwiGLU experts, top-6, plus one ungated shared expert that is always added."""

    def __init__(self, cfg, layer, make):
        super().__init__()
        E, I, S, C = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.hidden_size
        self.top_k, self.norm_topk_prob, self.eps = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.rms_norm_eps
        p = f"layers.{layer}.ffn."
        self.router = make(p + "router", E, C)                           # mlp.gate.weight
        self.gate_up = make(p + "gate_up", E, 2 * I, C)                  # per expert: gate rows, then up rows
        self.down = make(p + "down", E, C, I)
        self.shared_gate_up = make(p + "shared_gate_up", 2 * S, C)
        self.shared_down = make(p + "shared_down", C, S)

    def forward(self, x, dx, norm_w, ops):
        x, h, logits = ops.add_norm_linear(x, dx, norm_w, self.router, self.eps)  # [N, E]
        return x, ops.moe_experts(h, logits, self.gate_up, self.down, self.shared_gate_up, self.shared_down,
                                  self.top_k, self.norm_topk_prob)


class Block(nn.Module):
    def __init__(self, cfg, layer, make):
        super().__init__()
        self.attn_norm = make(f"layers.{layer}.attn_norm", cfg.hidden_size)  # input_layernorm
        self.attn = Attention(cfg, layer, make)
        self.ffn_norm = make(f"layers.{layer}.ffn_norm", cfg.hidden_size)    # post_attention_layernorm
        self.ffn = (MoE if cfg.is_moe(layer) else MLP)(cfg, layer, make)

    def forward(self, x, dx, pos, cache, rope, ops):
        # The residual stream is x + dx: each norm first adds the pending dx in fp32 (§2.2), so this is
        # x = x + attn(norm(x)); x = x + ffn(norm(x)) with the additions fused into the norms.
        x, dx = self.attn(x, dx, self.attn_norm, pos, cache, rope, ops)
        return self.ffn(x, dx, self.ffn_norm, ops)


class Transformer(nn.Module):
    def __init__(self, cfg, dtype=torch.bfloat16, device="cpu", nvfp4=()):
        """Empty weights of `dtype` on `device`; the flint weight names in `nvfp4` are NVFP4 (see load.py).
        On CUDA in bf16, decode steps use the Triton kernels and prompt chunks prefill_ops; elsewhere both use the
        reference ops (set decode_ops and prefill_ops to REFERENCE_OPS to compare)."""
        super().__init__()
        self.cfg = cfg
        V, C = cfg.vocab_size, cfg.hidden_size
        make = weight_factory(dtype, device, set(nvfp4))
        self.embed = make("embed", V, C)
        self.layers = nn.ModuleList(Block(cfg, i, make) for i in range(cfg.num_hidden_layers))
        self.norm = make("norm", C)
        self.lm_head = make("lm_head", V, C)
        self.rope = rope_table(cfg, 0, device)
        # the decode kernels take bf16 on CUDA, head_dim >= 32 (tensor-core tiles over half a head) and a
        # power-of-two expert count (one routing tile)
        fast = (torch.device(device).type == "cuda" and dtype == torch.bfloat16 and cfg.head_dim >= 32
                and cfg.num_experts & (cfg.num_experts - 1) == 0)
        self.decode_ops = kernel_ops() if fast else REFERENCE_OPS
        self.prefill_ops = prefill_ops() if fast else REFERENCE_OPS

    @property
    def dtype(self):
        return self.embed.dtype

    @property
    def device(self):
        return self.embed.device

    def weights(self):
        """(flint name, tensor or NVFP4) for every weight, in model order: what a loader must fill."""
        for name, m in self.named_modules():
            if isinstance(m, NVFP4):
                yield name, m
        yield from self.named_parameters()                               # NVFP4 holds buffers, not parameters

    @torch.inference_mode()
    def forward(self, ids, pos, cache=None, last_only=False):
        """ids, pos [B, T] (absolute positions, on the device) -> fp32 logits [B, T, V] ([B, 1, V] if last_only).

        With a cache, the new tokens' keys and values are written into it and attention sees everything cached;
        without one, the T tokens attend only to each other (a full recompute). Single-token steps (T = 1) use
        decode_ops and do no host sync, so they can be captured in a CUDA graph."""
        B, T = ids.shape
        ops = self.decode_ops if T == 1 else self.prefill_ops
        n = cache.max_seq_len if cache is not None else int(pos.max()) + 1
        if self.rope[0].shape[0] < n:                                    # fp32 cos/sin, built once per length
            self.rope = rope_table(self.cfg, n, self.device)
        x, dx = self.embed[ids.flatten()], None                          # [N, C]
        for block in self.layers:
            x, dx = block(x, dx, pos, cache, self.rope, ops)
        if last_only:
            x, dx, T = x.view(B, T, -1)[:, -1].contiguous(), dx.view(B, T, -1)[:, -1].contiguous(), 1  # [B, C]
        _, _, logits = ops.add_norm_linear(x, dx, self.norm, self.lm_head, self.cfg.rms_norm_eps, f32=True)
        return logits.view(B, T, -1)                                     # [B, T, V] fp32


def init_random(model, seed=0, std=0.02):
    """Random weights (the offline tiny demo, tests and benchmarks): N(0, std) matrices, norms near 1, O(1) sinks;
    NVFP4 weights get random codes and scales of about the same spread. Drawn on the model's device, so a
    full-size model initializes in seconds on a GPU."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    for name, w in model.weights():
        if isinstance(w, NVFP4):                                         # e2m1 codes have rms ~2.9: scale by std/3
            w.packed.random_(0, 256, generator=g)
            w.scales.copy_(torch.empty(w.scales.shape, device=w.scales.device).uniform_(0.2, 0.45, generator=g) * std)
            w.row_scale.fill_(1.0)
        else:
            scale, mean = (0.1, 1.0) if name.endswith("norm") else (1.0, 0.0) if name.endswith("sinks") else (std, 0)
            w.data.normal_(mean, scale, generator=g)
    return model


# -----------------------------------------------------------------------------
# KV cache


class KVCache:
    """Static K/V cache for B sequences, allocated once (§3): k[layer], v[layer] [B, S, G, D].

    Full-attention layers hold every position: S = max_seq_len, slot = position. Sliding layers hold a ring of
    S = min(sliding_window, max_seq_len) slots: position p lives in slot p % S and is overwritten S positions
    later. K is stored after q/k-norm and RoPE, V raw. Positions are written in order, so the position a slot
    holds follows from the newest one (slot_positions); attention masks by that position, never by slot order,
    and needs no position table. Starting again at position 0 is a reset: nothing older is visible."""

    def __init__(self, cfg, batch_size, max_seq_len, dtype, device):
        G, D = cfg.num_key_value_heads, cfg.head_dim
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        sizes = [min(cfg.sliding_window, max_seq_len) if cfg.is_sliding(i) else max_seq_len
                 for i in range(cfg.num_hidden_layers)]
        self.k = [torch.zeros(batch_size, S, G, D, dtype=dtype, device=device) for S in sizes]
        self.v = [torch.zeros_like(k) for k in self.k]

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def row(self, b):
        """The cache of sequence b alone, sharing storage: prompts of different lengths prefill one at a time."""
        view = copy.copy(self)
        view.k, view.v, view.batch_size = [t[b:b + 1] for t in self.k], [t[b:b + 1] for t in self.v], 1
        return view

    def store(self, layer, k, v, pos):
        """Store T new k, v [B, T, G, D] at positions pos [B, T] (in order, following what is cached); return the
        keys, values [B, S', G, D] and positions [B, S'] that these T queries attend over, in position order:
        k_pos[b, i] = k_pos[b, 0] + i (negative: never written), which lets the prefill kernel skip keys."""
        kc, vc = self.k[layer], self.v[layer]
        B, S = kc.shape[:2]
        rows = torch.arange(B, device=pos.device)[:, None]
        if S == self.max_seq_len:                                        # full layer: write, then read up to
            kc[rows, pos], vc[rows, pos] = k, v                          # the newest position (a host sync)
            n = int(pos[:, -1].max()) + 1
            return kc[:, :n], vc[:, :n], slot_positions(pos[:, -1:], S)[:, :n]
        # Sliding ring: a query needs up to S - 1 earlier keys that this chunk's own writes may overwrite, so
        # attend over the ring as it was (oldest first: positions p - S .. p - 1 sit in slots (p - S .. p - 1) % S)
        # plus the chunk, then keep the chunk's last S tokens.
        ring_pos = pos[:, :1] - S + torch.arange(S, device=pos.device)   # [B, S]
        oldest_first = ring_pos % S
        ks, vs = torch.cat([kc[rows, oldest_first], k], 1), torch.cat([vc[rows, oldest_first], v], 1)
        k_pos = torch.cat([ring_pos, pos], 1)
        kc[rows, pos[:, -S:] % S], vc[rows, pos[:, -S:] % S] = k[:, -S:], v[:, -S:]
        return ks, vs, k_pos


# -----------------------------------------------------------------------------
# Decode step: one CUDA graph per batch size


class DecodeStep:
    """next ids [B] = sample(model(ids [B], pos [B])) for the B sequences of `cache`, replayed from a CUDA graph.

    Everything the step reads lives in static buffers (ids, positions, the cache, the rope table), and the step
    itself writes the ids it samples and the positions + 1 there: a step is one replay, and the next one can be
    queued at once. Steps alternate between two id buffers (step n reads ids[n % 2] and writes ids[(n + 1) % 2],
    one graph each), so a step's output stays intact while the step after it runs: it can be copied to the host
    beside that step instead of between the two (generate.decode). The warm-up steps (which also compile the Triton
    kernels) write slot 0 of the cache, which is restored afterwards. graph=False runs the same steps eagerly."""

    def __init__(self, model, cache, temperature, top_k, top_p, n_vocab=None, graph=True):
        self.model, self.cache, self.graphs = model, cache, None
        self.sampling, self.n_vocab = (temperature, top_k, top_p), n_vocab
        B, dev = cache.batch_size, model.device
        self.ids = torch.zeros(2, B, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.n = 0                                                       # steps queued: the next one reads ids[n % 2]
        slot0 = [t[:, 0].clone() for t in cache.k + cache.v]
        self._warm_up()                                                  # (and the rope table)
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):                              # warmup on a side stream, as torch asks
                self._warm_up()
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
            for k, g in enumerate(self.graphs):                          # capture (one memory pool: they run in turn)
                with torch.cuda.graph(g, pool=self.graphs[0].pool() if k else None):
                    self._step(k)
        for t, saved in zip(cache.k + cache.v, slot0):
            t[:, 0] = saved

    def _warm_up(self):
        self.ids.zero_()
        self.pos.zero_()                                                 # (a step advances it)
        self._step(0)

    def _step(self, k):
        ids, out = self.ids[k], self.ids[1 - k]
        logits = self.model(ids, self.pos, self.cache)[:, -1]
        if self.sampling[0] == 0:                                        # greedy: one op (a kernel on the GPU)
            self.model.decode_ops.greedy_next(logits, self.n_vocab or logits.shape[-1], out, self.pos)
        else:
            out.copy_(self.sample(logits)[:, None])
            self.pos.add_(1)

    def sample(self, logits):
        """Next ids [B] from fp32 logits [B, V] with this step's sampling settings."""
        # ids past the tokenizer's (n_vocab None: none) are never drawn; a view, so the logits stay intact
        return sample(logits[:, :self.n_vocab], *self.sampling)

    def __call__(self, ids=None, pos=None):
        """Queues one step and returns its next ids [B]: a static buffer, the next step's input, which the step
        after that rewrites (copy it before queuing that one). ids, pos [B] on the device set the step's input;
        without them it goes on from the step before."""
        k = self.n % 2
        if ids is not None:
            self.ids[k].copy_(ids[:, None])
            self.pos.copy_(pos[:, None])
        if self.graphs is None:
            self._step(k)
        else:
            self.graphs[k].replay()
        self.n += 1
        return self.ids[1 - k, :, 0]


# -----------------------------------------------------------------------------
# Sampling: pure and sync-free, so it can run inside a CUDA graph


def logits_to_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """fp32 logits [B, V] -> probabilities [B, V] after temperature, top-k (0 = off) and top-p (1.0 = off)."""
    logits = logits / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]           # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        p, idx = torch.sort(probs, dim=-1, descending=True)
        drop = (p.cumsum(-1) - p) > top_p                                # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, idx, p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Next token ids [B] from fp32 logits [B, V]. Temperature 0 is greedy; otherwise the exponential race
    argmax(p / Exp(1)) draws from p without a host sync (gpt-fast, nano-vllm). With top-k, only the k best logits
    go on (the others' probabilities are 0): no sort or random draw over the whole vocabulary."""
    if temperature == 0:
        return logits.argmax(-1)
    ids = None
    if 0 < top_k < logits.shape[-1]:
        logits, ids = torch.topk(logits, top_k, dim=-1)                  # [B, k]
    probs = logits_to_probs(logits, temperature, 0, top_p)
    pick = (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)
    return pick if ids is None else ids.gather(-1, pick[:, None])[:, 0]
