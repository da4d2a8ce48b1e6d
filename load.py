"""Checkpoints for flint.py: HF BF16 safetensors, ModelOpt NVFP4 safetensors, GGUF files (the official NVFP4 one
and community quantizations), the tokenizer and the chat template.

Every format is read lazily (memory-mapped) and streamed into the model's preallocated weights one checkpoint tensor
at a time, so no second copy of the weights ever exists in host memory. Layout work (fusing q/k/v and gate/up,
stacking experts, repacking NVFP4 blocks) happens here, in plain functions; flint.py never sees checkpoint names.
Errors name the file or tensor, what was expected, what was found and what to do.
"""
import codecs
import datetime
import functools
import json
import math
import resource
import sys
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import gguf
import jinja2
import numpy as np
import regex
import tiktoken
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import SafetensorError, safe_open

import flint

# -----------------------------------------------------------------------------
# config.json -> Config, key by key (spec §1)

REQUIRED_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "num_experts", "num_experts_per_tok"]
OPTIONAL_KEYS = ["norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "layer_types", "no_rope_layer_indices",
                 "sliding_window", "rope_parameters", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                 "max_position_embeddings"]
# Keys whose value, when present, must be this one: anything else is math flint.py does not implement.
# (quantization_config is checked by modelopt_quantization: only ModelOpt NVFP4 exports load.)
FIXED_VALUES = {"model_type": "flint", "hidden_act": "silu", "attention_bias": False, "use_sliding_window": True,
                "router_score_function": "sigmoid", "softmax_type": "learnable", "rope_scaling": None}


def config_from_hf(d, source="config.json"):
    """Config from the keys of an HF config.json (a dict)."""
    if d.get("model_type") is None:
        raise ValueError(f"{source}: no model_type; expected 'flint'. Is this the config.json of a Flint checkpoint?")
    for key, want in FIXED_VALUES.items():
        if key in d and d[key] != want:
            raise ValueError(f"{source}: {key} is {d[key]!r}, but flint.py runs only {want!r}; this checkpoint "
                             f"is not a Flint model it can run")
    missing = [k for k in REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"{source}: missing keys {missing}; every Flint config.json has them (transformers "
                         f"FlintConfig): add them with the checkpoint's values")
    try:
        return flint.Config(**{k: d[k] for k in REQUIRED_KEYS + OPTIONAL_KEYS if d.get(k) is not None})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None


# -----------------------------------------------------------------------------
# Checkpoint names -> flint weights, for every format
#
# A table maps each flint weight to checkpoint tensor name(s), per layer under `layer_prefix` ("{}" = the layer
# index). A list fills the weight's rows in order (q/k/v into qkv, gate/up into gate_up), and "{E}" names one
# expert of a stacked [E, ...] weight; without "{E}" the checkpoint stacks the experts itself (GGUF).


class NameTable(NamedTuple):
    top: dict                   # embed, norm, lm_head
    layer_prefix: str
    layer: dict                 # every layer: norms and attention
    dense: dict                 # layers in mlp_only_layers
    moe: dict                   # the others
    aliases: dict               # one tensor for the whole weight, used when the checkpoint has it


# HF safetensors (spec §4a); ModelOpt NVFP4 exports use the same names (spec §4b)
HF_NAMES = NameTable(
    top={"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"},
    layer_prefix="model.layers.{}.",
    layer={
        "attn_norm": "input_layernorm.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "attn.qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        "attn.o": "self_attn.o_proj.weight",
        "attn.q_norm": "self_attn.q_norm.weight",
        "attn.k_norm": "self_attn.k_norm.weight",
        "attn.sinks": "self_attn.softmax_offset",                       # no ".weight"
    },
    dense={"ffn.gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "ffn.down": "mlp.down_proj.weight"},
    moe={
        "ffn.router": "mlp.gate.weight",
        "ffn.gate_up": ["mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"],
        "ffn.down": "mlp.experts.{E}.down_proj.weight",
        "ffn.shared_gate_up": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
        "ffn.shared_down": "mlp.shared_expert.down_proj.weight",
    },
    # transformers' in-memory names, which some exports write instead
    aliases={"attn.sinks": "self_attn.sinks", "ffn.gate_up": "mlp.experts.gate_up_proj",
             "ffn.down": "mlp.experts.down_proj"},
)
HF_IGNORED = ("rotary_emb.inv_freq",)                                   # recomputed from rope_theta

# GGUF (spec §4c, the names of vLLM's gguf_nvfp4.py). NVFP4 tensors carry their global scale in "<name>.scale"
# (".weight" -> ".scale"); experts are stacked [E, N, K], with gate and up separate.
GGUF_NAMES = NameTable(
    top={"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"},
    layer_prefix="blk.{}.",
    layer={
        "attn_norm": "attn_norm.weight",
        "ffn_norm": "ffn_norm.weight",
        "attn.qkv": ["attn_q.weight", "attn_k.weight", "attn_v.weight"],
        "attn.o": "attn_output.weight",
        "attn.q_norm": "attn_q_norm.weight",
        "attn.k_norm": "attn_k_norm.weight",
        "attn.sinks": "attn_sinks.weight",
    },
    dense={"ffn.gate_up": ["ffn_gate.weight", "ffn_up.weight"], "ffn.down": "ffn_down.weight"},
    moe={
        "ffn.router": "ffn_gate_inp.weight",
        "ffn.gate_up": ["ffn_gate_exps.weight", "ffn_up_exps.weight"],
        "ffn.down": "ffn_down_exps.weight",
        "ffn.shared_gate_up": ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"],
        "ffn.shared_down": "ffn_down_shexp.weight",
    },
    aliases={},
)

# The weights flint.py can run as NVFP4 (linear layers); any other weight is dequantized at load
NVFP4_WEIGHTS = ("attn.qkv", "attn.o", "ffn.gate_up", "ffn.down", "ffn.shared_gate_up", "ffn.shared_down", "lm_head")


def split_rows(w, sizes):
    """Views of consecutive row blocks (dim -2) of a weight, a tensor or NVFP4: q/k/v of qkv, gate/up of gate_up."""
    if isinstance(w, flint.NVFP4):
        return [flint.NVFP4(p, s, r) for p, s, r in zip(w.packed.split(sizes, -2), w.scales.split(sizes, -2),
                                                        w.row_scale.split(sizes, -1))]
    return list(w.split(sizes, -2))


def pieces(cfg, table, name, w, available):
    """The (view of weight w, checkpoint tensor name) pairs that together fill flint weight `name` exactly."""
    if name in table.top:
        return [(w, table.top[name])]
    _, L, key = name.split(".", 2)
    prefix = table.layer_prefix.format(L)
    if key in table.aliases and prefix + table.aliases[key] in available:
        return [(w, prefix + table.aliases[key])]
    names = {**table.layer, **(table.moe if cfg.is_moe(int(L)) else table.dense)}[key]
    names = [names] if isinstance(names, str) else names
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_expert = "{E}" in names[0]
    out = []
    for e in range(cfg.num_experts if per_expert else 1):
        dst = w[e] if per_expert else w
        if len(names) == 1:
            parts = [dst]
        else:                                                           # q/k/v, or the gate and up halves
            parts = split_rows(dst, [H * D, G * D, G * D] if key == "attn.qkv" else [dst.shape[-2] // 2] * 2)
        out += [(p, prefix + n.replace("{E}", str(e))) for p, n in zip(parts, names)]
    return out


def plan(model, table, available, quantized, companions, ignored, where):
    """[(view, checkpoint tensor, flint weight)] filling every weight of the model. A missing tensor is an error,
    and so is one left unused (besides the companions of quantized tensors and names ending in `ignored`)."""
    items = []
    for name, w in model.weights():
        for dst, src in pieces(model.cfg, table, name, w, available):
            if src not in available:
                raise ValueError(f"{where}: tensor {src} (for flint {name}) is missing; the checkpoint is incomplete "
                                 f"or not a Flint model with this config")
            items.append((dst, src, name))
    used = {src for _, src, _ in items}
    used |= {c for src in used if quantized(src) for c in companions(src)}
    unused = sorted(n for n in available if n not in used and not n.endswith(ignored))
    if unused:
        raise ValueError(f"{where}: {len(unused)} unexpected tensors, e.g. {unused[:5]}; flint.py would ignore "
                         f"them, so the checkpoint is not the Flint model its config describes")
    return items


def build_model(cfg, dtype, device, plan_fn, quantized, where):
    """The model, with NVFP4 exactly for the linear weights whose checkpoint tensors are all NVFP4, and its plan.

    Planned once on a meta model (no memory) to read the file's types, then on the real one. A weight that mixes
    NVFP4 with other types, or that flint.py runs unquantized (embedding, router), gets its NVFP4 parts
    dequantized, global scale included, and a notice says so."""
    is_nvfp4 = {}
    for _, src, name in plan_fn(flint.Transformer(cfg, dtype, "meta")):
        is_nvfp4.setdefault(name, []).append(quantized(src))
    nvfp4 = {n for n, q in is_nvfp4.items() if all(q) and n.endswith(NVFP4_WEIGHTS)}
    demoted = sorted(n for n, q in is_nvfp4.items() if any(q) and n not in nvfp4)
    if demoted:
        print(f"notice: {where}: the NVFP4 tensors of {len(demoted)} weights ({', '.join(demoted[:4])}"
              f"{', ...' if len(demoted) > 4 else ''}) are dequantized to {dtype} at load: those weights mix NVFP4 "
              f"with other types, or flint.py runs them unquantized", file=sys.stderr)
    model = flint.Transformer(cfg, dtype, device, nvfp4)
    return model, plan_fn(model)


@torch.no_grad()
def put(dst, v, src, where):
    """Copy checkpoint value v (a tensor, or NVFP4 with its global scales) into dst, a view of one model weight."""
    if tuple(v.shape) != tuple(dst.shape):
        raise ValueError(f"{where}: tensor {src} has shape {list(v.shape)}, expected {list(dst.shape)} from the "
                         f"checkpoint's config; the config does not match the weights")
    if isinstance(dst, flint.NVFP4):
        assert isinstance(v, flint.NVFP4), f"{src}: an NVFP4 weight planned from a tensor of another type"
        dst.packed.copy_(v.packed)
        dst.scales.copy_(v.scales)
        dst.row_scale.copy_(v.row_scale)
    elif isinstance(v, flint.NVFP4):                                    # a weight flint runs unquantized
        dst.copy_(v.dequantize() * v.row_scale[..., None])
    else:
        dst.copy_(v)                                                    # host -> device, with the dtype cast


def _progress(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr,
                disable=not enabled or None, leave=False)


# -----------------------------------------------------------------------------
# HF safetensors directories: BF16 (spec §4a) and ModelOpt NVFP4 exports (spec §4b)

MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")  # we run both as W4A16: bf16 activations
MODELOPT_GROUP = 16                        # weights per E4M3 block scale
MODELOPT_IGNORED = (".input_scale", ".k_scale", ".v_scale")  # activation and KV-cache scales: W4A16, bf16 cache


def safetensors_files(ckpt):
    """tensor name -> shard path, from model.safetensors.index.json or a single model.safetensors."""
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object; expected {{tensor name: shard file}}")
        files = {name: ckpt / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.exists():
                raise FileNotFoundError(f"{f}: listed in {index.name} but missing; download the whole checkpoint "
                                        f"again (e.g. huggingface-cli download)")
        return files
    single = ckpt / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{ckpt}: no model.safetensors or model.safetensors.index.json; expected an HF "
                                f"checkpoint directory (config.json plus safetensors shards)")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def _open_safetensors(path):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}); the file is truncated or corrupt: "
                         f"download it again") from None


def modelopt_quantization(config, hf_quant_config, source):
    """The ModelOpt quant_algo of a checkpoint (None: BF16), from config.json's quantization_config and/or
    hf_quant_config.json's "quantization"; anything but NVFP4 weights in groups of 16 is refused."""
    qc = config.get("quantization_config")
    if qc is None and hf_quant_config is None:
        return None
    q = {**((hf_quant_config or {}).get("quantization") or {}), **(qc or {})}
    method, algo = q.get("quant_method", "modelopt"), q.get("quant_algo")
    if method != "modelopt" or algo not in MODELOPT_ALGOS:
        raise ValueError(f"{source}: quantization quant_method {method!r}, quant_algo {algo!r}; flint.py runs BF16 "
                         f"checkpoints and ModelOpt NVFP4 exports (quant_algo {' or '.join(MODELOPT_ALGOS)}) only")
    groups = [q.get("group_size")] + [(g.get("weights") or {}).get("group_size")
                                      for g in (q.get("config_groups") or {}).values()]
    bad = [g for g in groups if g is not None and g != MODELOPT_GROUP]
    if bad:
        raise ValueError(f"{source}: NVFP4 group_size {bad[0]}, but NVFP4 has one E4M3 scale per {MODELOPT_GROUP} "
                         f"weights; this export is not NVFP4 as flint.py reads it")
    return algo


def load_hf_weights(model, files, items, quantized, progress=True):
    """Stream the planned tensors of a safetensors checkpoint into the model, shard by shard (each shard is
    memory-mapped only while it is read). A quantized tensor brings its ModelOpt companions, wherever they are."""
    shards = {}
    for item in items:
        shards.setdefault(files[item[1]], []).append(item)
    bar = _progress(sum(_nbytes(d) for d, _, _ in items), progress)
    for shard, shard_items in shards.items():
        with _open_safetensors(shard) as f:
            read = functools.partial(_read, files, f, shard)
            for dst, src, _ in shard_items:
                if quantized(src):
                    v = modelopt_nvfp4(read, src, shard)
                else:
                    v = read(src)
                    if not v.is_floating_point():
                        raise ValueError(f"{shard}: tensor {src} has dtype {v.dtype}, expected a float type "
                                         f"(BF16/F32); a ModelOpt NVFP4 weight needs its weight_scale beside it")
                put(dst, v, src, shard)
                bar.update(_nbytes(dst))
    bar.close()


def _read(files, f, shard, name):
    """Tensor `name` from the open shard f, or from its own shard (a companion stored in another one)."""
    if name not in files:
        raise ValueError(f"checkpoint: tensor {name} is missing; a ModelOpt NVFP4 weight comes with weight_scale and "
                         f"weight_scale_2: the export is incomplete")
    if files[name] == shard:
        return _get_tensor(f, name, shard)
    with _open_safetensors(files[name]) as g:
        return _get_tensor(g, name, files[name])


def _get_tensor(f, name, shard):
    try:
        return f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{shard}: cannot read tensor {name} ({e}); the file is corrupt: download it again") from None


def _nbytes(w):
    parts = (w.packed, w.scales, w.row_scale) if isinstance(w, flint.NVFP4) else (w,)
    return sum(p.numel() * p.element_size() for p in parts)


def _modelopt_companions(src):
    base = src.removesuffix("weight")
    return [base + "weight_scale", base + "weight_scale_2"]


def modelopt_nvfp4(read, src, where):
    """One ModelOpt NVFP4 linear weight as flint.NVFP4: `X.weight` uint8 [N, K/2] (element 2j in the low nibble),
    `X.weight_scale` E4M3 [N, K/16], `X.weight_scale_2` fp32 global scale ([] or [1]). Already flint's layout."""
    scale_name, global_name = _modelopt_companions(src)
    w, s, g = read(src), read(scale_name), read(global_name)
    if w.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn or not g.is_floating_point():
        raise ValueError(f"{where}: {src} / {scale_name} / {global_name} have dtypes {w.dtype} / {s.dtype} / "
                         f"{g.dtype}, expected uint8 / float8_e4m3fn (F8_E4M3) / float32")
    if w.dim() != 2 or s.shape != (w.shape[0], w.shape[1] // 8) or w.shape[1] % 8:
        raise ValueError(f"{where}: {scale_name} has shape {list(s.shape)} for {src} {list(w.shape)}; expected one "
                         f"E4M3 scale per {MODELOPT_GROUP} weights, [{w.shape[0]}, {2 * w.shape[-1] // 16}]: the "
                         f"export's group size is not {MODELOPT_GROUP}")
    if g.numel() != 1 or not math.isfinite(g.item()):
        raise ValueError(f"{where}: {global_name} is {g.tolist()}, expected one finite fp32 global scale")
    nan = (s.view(torch.uint8) & 0x7F) == 0x7F                         # e4m3fn NaN: S.1111.111
    if nan.any():
        raise ValueError(f"{where}: {scale_name} holds {int(nan.sum())} NaN scale bytes (0x7F/0xFF); the export is "
                         f"corrupt: download it again")
    return flint.NVFP4(w, s, g.float().reshape(()).expand(w.shape[0]))


def load_hf_dir(ckpt, device, dtype, progress):
    """Model, tokenizer, chat template and sampling defaults from a BF16 or ModelOpt NVFP4 checkpoint directory."""
    config = _read_json(ckpt / "config.json", required=True)
    cfg = config_from_hf(config, str(ckpt / "config.json"))
    quant = modelopt_quantization(config, _read_json(ckpt / "hf_quant_config.json"), str(ckpt / "config.json"))
    files = safetensors_files(ckpt)
    tokenizer = Tokenizer.from_files(ckpt / "tokenizer.json", _maybe(ckpt / "tokenizer_config.json"),
                                     _maybe(ckpt / "generation_config.json"), ckpt / "config.json")
    _check_vocab(tokenizer, cfg, ckpt / "tokenizer.json")
    def quantized(src):                             # ModelOpt, per tensor: a uint8 weight plus its weight_scale
        return bool(quant) and src.endswith(".weight") and _modelopt_companions(src)[0] in files

    def plan_hf(model):
        ignored = HF_IGNORED + (MODELOPT_IGNORED if quant else ())
        return plan(model, HF_NAMES, files, quantized, _modelopt_companions, ignored, "checkpoint")

    model, items = build_model(cfg, dtype, device, plan_hf, quantized, ckpt.name)
    load_hf_weights(model, files, items, quantized, progress)
    gen = _read_json(ckpt / "generation_config.json") or {}
    sampling = {k: gen.get(k, v) for k, v in SAMPLING_DEFAULTS.items()}
    return model, tokenizer, find_chat_template(ckpt), sampling


def _check_vocab(tokenizer, cfg, where):
    if tokenizer.n_vocab > cfg.vocab_size:
        raise ValueError(f"{where}: token ids reach {tokenizer.n_vocab - 1}, beyond the model's vocab_size "
                         f"{cfg.vocab_size}; the tokenizer does not belong to this checkpoint")


# -----------------------------------------------------------------------------
# GGUF files (spec §4c): the official NVFP4 GGUF, and any type the gguf package can dequantize
#
# Read with gguf.GGUFReader, which memory-maps the file, checks magic and version and honours general.alignment.
# Its ReaderTensor.shape is in ggml order (K first); flint wants the reverse. Tensor bytes are mapped again one
# tensor at a time (np.memmap, unmapped when dropped), so host memory holds about one tensor, never the model.

# ggml types (ggml.h enum ggml_type = gguf.GGMLQuantizationType)
GGML_F32, GGML_F16, GGML_BF16, GGML_NVFP4 = 0, 1, 30, 40
GGML_FLOATS = {GGML_F32: torch.float32, GGML_F16: torch.float16, GGML_BF16: torch.bfloat16}
# The ggml NVFP4 block: 64 weights in 4 sub-blocks of 16, each with a UE4M3 scale (unsigned E4M3, bias 7)
NVFP4_BLOCK_BYTES = 36          # 4 UE4M3 scales + 32 bytes of nibbles per 64 weights
NVFP4_SCALES = 4                # bytes 0-3: the sub-block scales; then qs[4][8]: sub-block j, byte i holds
                                # element 16j+i in the low nibble and 16j+8+i in the high one
UE4M3_MASK = 0x7F               # exponent and mantissa bits; ggml ignores bit 7 (UE4M3 has no sign)
UE4M3_ZERO = 0x7F               # decodes to 0 in ggml, but reads as NaN in e4m3fn: repacked as 0x00
UE4M3_INVALID = 0xFF            # ggml would decode it as 480; vLLM refuses it, and so do we
GGUF_GATING = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}  # llama.cpp
GGUF_SIGMOID = 2

# Config field <- GGUF key (under "flint."); all required
GGUF_CONFIG = {
    "num_hidden_layers": "block_count",
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",                        # the dense MLP of the leading layers
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "sliding_window": "attention.sliding_window",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "norm_topk_prob": "expert_weights_norm",
}
GGUF_REQUIRED = [*GGUF_CONFIG.values(), "leading_dense_block_count", "attention.sliding_window_pattern",
                 "expert_gating_func"]
# Keys whose value, when present, must be this one (absent: this value)
GGUF_FIXED = {"expert_weights_scale": 1.0, "expert_shared_count": 1, "rope.scaling.type": "none"}


def open_gguf(path):
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); the file is truncated or "
                         f"corrupt: download it again") from None
    if reader.byte_order != "I":
        raise ValueError(f"{path}: a big-endian GGUF; flint.py reads little-endian files (as llama.cpp writes them)")
    size = Path(path).stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, past the end of "
                             f"the {size}-byte file; the file is truncated: download it again")
    return reader


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, source):
    """Config from GGUF metadata, key by key (spec §4c); the vocab size comes from token_embd's shape."""
    arch = _field(reader, "general.architecture")
    if arch != "flint":
        raise ValueError(f"{source}: general.architecture is {arch!r}, expected 'flint'; this GGUF holds another "
                         f"model")
    missing = [f"flint.{k}" for k in GGUF_REQUIRED if f"flint.{k}" not in reader.fields]
    if missing:
        raise ValueError(f"{source}: metadata keys {missing} are missing; every Flint GGUF has them: the file was "
                         f"written by a converter that does not know Flint, or is incomplete")

    def get(key, default=None):
        return _field(reader, f"flint.{key}", default)

    gating = get("expert_gating_func")
    if gating != GGUF_SIGMOID:
        raise ValueError(f"{source}: flint.expert_gating_func is {gating} ({GGUF_GATING.get(gating, 'unknown')}), "
                         f"but Flint routes with sigmoid (2)")
    for key, want in GGUF_FIXED.items():
        if get(key, want) != want:
            raise ValueError(f"{source}: flint.{key} is {get(key)!r}, but flint.py runs only {want!r}")
    theta = get("rope.freq_base")
    if get("rope.freq_base_swa", theta) != theta:
        raise ValueError(f"{source}: flint.rope.freq_base_swa {get('rope.freq_base_swa')} differs from "
                         f"rope.freq_base {theta}; Flint has one RoPE theta (its meaning here is unknown)")
    if get("attention.value_length", get("attention.key_length")) != get("attention.key_length"):
        raise ValueError(f"{source}: flint.attention.value_length differs from key_length; Flint's heads are square")
    L = get("block_count")
    sliding, rope = get("attention.sliding_window_pattern"), get("attention.rope_pattern")
    for key, pattern in (("sliding_window_pattern", sliding), ("rope_pattern", rope)):
        if pattern is not None and len(pattern) != L:
            raise ValueError(f"{source}: flint.attention.{key} has {len(pattern)} entries, expected one per block "
                             f"({L})")
    embed = next((t for t in reader.tensors if t.name == GGUF_NAMES.top["embed"]), None)
    if embed is None or len(embed.shape) != 2:
        raise ValueError(f"{source}: no 2-D tensor {GGUF_NAMES.top['embed']}, which gives the vocab size; the "
                         f"file is incomplete")
    vocab = int(embed.shape[1])                                         # ggml order: [C, V]
    if get("vocab_size", vocab) != vocab:
        raise ValueError(f"{source}: flint.vocab_size {get('vocab_size')} but {embed.name} has {vocab} rows")
    kwargs = {field: get(key) for field, key in GGUF_CONFIG.items()}
    kwargs.update(vocab_size=vocab, mlp_only_layers=list(range(get("leading_dense_block_count"))),
                  layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                  no_rope_layer_indices=None if rope is None else [i for i, r in enumerate(rope) if not r])
    try:
        return flint.Config(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None


def repack_nvfp4(blocks, name="NVFP4 tensor"):
    """ggml NVFP4 blocks uint8 [..., K/64*36] -> flint.NVFP4's (packed [..., K/2] uint8, scales [..., K/16]
    float8_e4m3fn), losslessly (spec §4c). Vectorized: runs where `blocks` is (the GPU, after a raw-byte copy)."""
    b = blocks.unflatten(-1, (-1, NVFP4_BLOCK_BYTES))                   # [..., K/64, 36]
    d = b[..., :NVFP4_SCALES]                                           # [..., K/64, 4] UE4M3
    qs = b[..., NVFP4_SCALES:].unflatten(-1, (NVFP4_SCALES, 8))         # [..., K/64, 4, 8]
    invalid = d == UE4M3_INVALID
    if invalid.any():
        raise ValueError(f"{name}: {int(invalid.sum())} NVFP4 block scales are the invalid byte 0xFF; the file is "
                         f"corrupt: download it again")
    # ggml byte i holds elements (i, i+8) of its 16; flint byte t holds (2t, 2t+1). So flint bytes 0-3 pair the low
    # nibbles of ggml bytes (0,1), (2,3), ..., and bytes 4-7 pair their high nibbles.
    even, odd = qs[..., 0::2], qs[..., 1::2]                            # [..., K/64, 4, 4]
    packed = torch.cat([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], dim=-1)  # uint8 shifts wrap
    d = d & UE4M3_MASK
    scales = d.masked_fill(d == UE4M3_ZERO, 0)                          # 0x00-0x7E: UE4M3 bits == e4m3fn bits
    return packed.flatten(-3), scales.flatten(-2).view(torch.float8_e4m3fn)


def _gguf_bytes(path, t):
    """The bytes of GGUF tensor t as a uint8 tensor, memory-mapped for this tensor alone (unmapped when dropped;
    copy-on-write mode, so numpy hands out a writable array and torch does not warn)."""
    return torch.from_numpy(np.memmap(path, np.uint8, mode="c", offset=t.data_offset, shape=(t.n_bytes,)))


def gguf_value(path, t, scale, device):
    """A float or NVFP4 tensor as a tensor on the host (a view of the mapped bytes) or, NVFP4, a flint.NVFP4
    repacked on `device` with its global scale (`scale`: the .scale tensor, None = 1.0) repeated over the rows."""
    raw = _gguf_bytes(path, t)
    if t.tensor_type in GGML_FLOATS:
        return raw.view(GGML_FLOATS[t.tensor_type]).view(_torch_shape(t))
    packed, scales = repack_nvfp4(raw.view(t.data.shape).to(device), f"{path}: {t.name}")
    rows = packed.shape[:-1]
    n = math.prod(rows[:-1])                                            # 1, or the number of experts
    g = torch.ones(n) if scale is None else gguf_value(path, scale, None, device).float()
    if g.numel() != n or not g.isfinite().all():
        raise ValueError(f"{path}: {scale.name} has {g.numel()} values {g.tolist()[:4]}..., expected "
                         f"{n} finite global scale(s) for {t.name} (one per expert when stacked)")
    return flint.NVFP4(packed, scales, g.to(device).reshape(*rows[:-1], 1).expand(rows))


@torch.no_grad()
def dequantize_into(dst, raw, qtype, rows=256):
    """dst = gguf's dequantization of raw (numpy bytes of any ggml type it knows), `rows` rows at a time, so host
    memory stays bounded for community quantizations (Q8_0, K-quants, ...)."""
    if dst.dim() > 2:
        for i in range(dst.shape[0]):
            dequantize_into(dst[i], raw[i], qtype, rows)
    elif dst.dim() == 1:
        dst.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    else:
        for a in range(0, dst.shape[0], rows):
            dst[a:a + rows].copy_(torch.from_numpy(gguf.quants.dequantize(raw[a:a + rows], qtype)))


def _can_dequantize(qtype):
    if qtype in GGML_FLOATS or qtype == GGML_NVFP4:
        return True
    try:                                                                # one zero block
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        return True
    except NotImplementedError:
        return False


def load_gguf_weights(path, model, items, tensors, progress=True):
    """Stream the planned GGUF tensors into the model, in file order, one mapped tensor at a time."""
    items = sorted(items, key=lambda item: tensors[item[1]].data_offset)
    bar = _progress(sum(tensors[src].n_bytes for _, src, _ in items), progress)
    for dst, src, _ in items:
        t = tensors[src]
        if t.tensor_type in GGML_FLOATS or t.tensor_type == GGML_NVFP4:
            put(dst, gguf_value(path, t, tensors.get(_gguf_scale_name(src)), model.device), src, path)
        else:
            dequantize_into(dst, _gguf_bytes(path, t).numpy().reshape(t.data.shape), t.tensor_type)
        bar.update(t.n_bytes)
    bar.close()


def _torch_shape(t):
    return tuple(reversed([int(n) for n in t.shape]))                   # ggml order (K first) -> torch order


def _gguf_scale_name(src):
    return src.removesuffix(".weight") + ".scale"


def load_gguf(path, device, dtype, progress):
    """Model, tokenizer, chat template and sampling defaults from one GGUF file."""
    reader = open_gguf(path)
    where = str(path)
    cfg = config_from_gguf(reader, where)
    prec_a4 = _field(reader, "general.tensor_extra.prec_a4", [])
    if any(prec_a4 if isinstance(prec_a4, list) else [prec_a4]):
        raise ValueError(f"{where}: general.tensor_extra.prec_a4 marks tensors for FP4 activations (W4A4); flint.py "
                         f"runs NVFP4 weights with bf16 activations (W4A16) only, so this file would not compute "
                         f"what its producer intended")
    beside = path.parent / "config.json"
    if beside.is_file():
        _cross_check(cfg, config_from_hf(_read_json(beside, required=True), str(beside)), where, str(beside))
    tokenizer = tokenizer_from_gguf(reader, where)                      # before the weights: fail fast
    _check_vocab(tokenizer, cfg, where)
    tensors = {t.name: t for t in reader.tensors}

    def quantized(src):
        return tensors[src].tensor_type == GGML_NVFP4

    def plan_gguf(model):
        return plan(model, GGUF_NAMES, tensors, quantized, lambda src: [_gguf_scale_name(src)], (), where)

    model, items = build_model(cfg, dtype, device, plan_gguf, quantized, path.name)
    other = {}                                                          # ggml type name -> tensor count
    for dst, src, _ in items:
        t = tensors[src]
        if _torch_shape(t) != tuple(dst.shape):
            raise ValueError(f"{where}: tensor {src} has shape {list(_torch_shape(t))} (ggml ne {t.shape.tolist()}), "
                             f"expected {list(dst.shape)} from the flint.* metadata; the metadata does not match the "
                             f"weights")
        if not _can_dequantize(t.tensor_type):
            raise ValueError(f"{where}: tensor {src} has ggml type {t.tensor_type.name}, which the gguf package "
                             f"cannot dequantize; convert the file to NVFP4, BF16 or a K-quant")
        if t.tensor_type not in GGML_FLOATS and t.tensor_type != GGML_NVFP4:
            other[t.tensor_type.name] = other.get(t.tensor_type.name, 0) + 1
    if other:
        print(f"notice: {path.name}: {sum(other.values())} tensors of type "
              f"{', '.join(f'{k} ({n})' for k, n in other.items())} are dequantized to {dtype} at load; they run at "
              f"{dtype} memory and speed", file=sys.stderr)
    load_gguf_weights(path, model, items, tensors, progress)
    sampling = {k: _field(reader, f"general.sampling.{gk}", v)
                for (k, v), gk in zip(SAMPLING_DEFAULTS.items(), ("temp", "top_p", "top_k"))}
    return model, tokenizer, _field(reader, "tokenizer.chat_template"), sampling


def _cross_check(cfg, other, where, other_where):
    """The GGUF metadata and a config.json beside it must describe the same model (floats to float32 precision)."""
    a, b = asdict(cfg), asdict(other)
    for key in set(a) - {"rope_parameters"}:
        same = math.isclose(a[key], b[key], rel_tol=1e-6) if isinstance(a[key], float) else a[key] == b[key]
        if not same:
            raise ValueError(f"{where}: {key} is {a[key]!r} in the GGUF metadata but {b[key]!r} in {other_where}; "
                             f"remove the config.json that does not belong to this file")


def tokenizer_from_gguf(reader, where):
    """The tokenizer from tokenizer.ggml.* (spec §5); stop ids = eos ∪ eot ∪ eom ∪ eog."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{where}: tokenizer.ggml.model is {model!r}, expected 'gpt2' (byte-level BPE); "
                         f"{'the file has no tokenizer' if model is None else 'flint.py reads byte-level BPE only'}")
    keys = {k: f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "pre")}
    missing = [key for key in keys.values() if key not in reader.fields]
    if missing:
        raise ValueError(f"{where}: metadata keys {missing} are missing; the embedded tokenizer is incomplete")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = [i for i in eos + _field(reader, "tokenizer.ggml.eog_token_ids", []) if i is not None]
    return Tokenizer.from_gguf_fields(*(_field(reader, keys[k]) for k in ("tokens", "token_type", "merges")),
                                      bos_id=_field(reader, "tokenizer.ggml.bos_token_id"), eos_ids=eos,
                                      pre=_field(reader, keys["pre"]),
                                      pad_id=_field(reader, "tokenizer.ggml.padding_token_id"))


# ----------------------------------------------------------------------------
# Byte-level alphabet (GPT-2 bytes_to_unicode): vocab strings are bytes in disguise. Printable
# Latin-1 bytes stand for themselves; the other 68 (space, controls, 0x7F-0xA0, 0xAD) become
# U+0100, U+0101, ... in byte order.

_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_TO_CHAR = {b: chr(b) for b in _PRINTABLE}
BYTE_TO_CHAR |= {b: chr(0x100 + i) for i, b in enumerate(b for b in range(256) if b not in BYTE_TO_CHAR)}
# str.translate table that undoes it; characters outside the alphabet become U+FFFF, on which the
# following .encode("latin-1") fails.
_UNBYTE = {ord(c): b for b, c in BYTE_TO_CHAR.items()} | {b: 0xFFFF for b in range(256) if b not in _PRINTABLE}

# Flint's pre-tokenizer (spec §5): three "isolated" Splits, then ByteLevel(add_prefix_space=False,
# use_regex=False). Used for GGUF pre == "flint"; tokenizer.json files carry their own. Checked on
# every code point against tokenizers 0.23.3: only the 17,810 first assigned in Unicode 17 (known to
# `regex` 2026.11, unassigned for tokenizers' Oniguruma) can split differently.
FLINT_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"  # ByteLevel(use_regex)
_PREFIX_SPACE = "prefix space"  # the pre-tokenizer step of ByteLevel(add_prefix_space=True)
# HF AddedVocabulary uses Rust regex classes: \s is White_Space (Python's isspace adds \x1c-\x1f)
# and \w is the UTS#18 word class.
_SPACE = regex.compile(r"\p{White_Space}")
_WORD = regex.compile(r"[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]")
_NORMAL_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_NEVER = float("inf")


def _unbyte(s: str) -> bytes | None:
    """Bytes of a byte-level vocab string, or None when it has characters outside the alphabet."""
    try:
        return s.translate(_UNBYTE).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _read_json(path, required: bool = False) -> dict | None:
    """Parse a JSON file; a missing optional file (or path None) gives None."""
    if path is None or not Path(path).is_file():
        if required:
            raise FileNotFoundError(f"{path}: no such file; a checkpoint directory holds config.json, "
                                    f"tokenizer.json and the safetensors")
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON ({e}); re-download the file") from e


def _merge_pair(m, where: str) -> tuple[str, str]:
    """One merge as (left, right): tokenizers writes ["a", "b"] lists, older files and GGUF "a b"."""
    parts = m.split(" ") if isinstance(m, str) else m
    if not (isinstance(parts, list) and len(parts) == 2 and all(isinstance(p, str) for p in parts)):
        raise ValueError(f"{where}: merge {m!r} is neither 'a b' nor ['a', 'b']; the file is corrupt")
    return parts[0], parts[1]


def _pre_tokenizer_steps(spec: dict | None, where: str) -> list:
    """tokenizer.json's pre_tokenizer as a list of split regexes (and the prefix-space step)."""
    parts = spec.get("pretokenizers", []) if spec and spec.get("type") == "Sequence" else [spec] if spec else []
    steps, byte_level = [], False
    for p in parts:
        kind = p.get("type")
        if byte_level:  # a split after ByteLevel would see the byte alphabet, not the text
            raise ValueError(f"{where}: pre-tokenizer {kind} after ByteLevel is not supported; put ByteLevel last")
        if kind == "Split":
            # "Isolated" keeps matches and gaps alike as pieces, so `invert` cannot change the result.
            if p.get("behavior") != "Isolated":
                raise ValueError(f"{where}: Split behavior {p.get('behavior')!r} is not supported; expected 'Isolated'")
            pat = p.get("pattern") or {}
            try:
                steps.append(regex.compile(pat["Regex"] if "Regex" in pat else regex.escape(pat["String"])))
            except (KeyError, regex.error) as e:
                raise ValueError(f"{where}: Split pattern {pat!r}: no Regex or String `regex` compiles ({e})") from e
        elif kind == "ByteLevel":
            byte_level = True
            steps += [_PREFIX_SPACE] if p.get("add_prefix_space") else []
            steps += [regex.compile(_GPT2_SPLIT)] if p.get("use_regex", True) else []
        else:
            raise ValueError(f"{where}: pre-tokenizer {kind!r} is not supported; flint reads Split and ByteLevel")
    if not byte_level:
        raise ValueError(f"{where}: the pre-tokenizer has no ByteLevel step; flint reads byte-level BPE only")
    return steps


def _split_isolated(rx: regex.Pattern, s: str) -> list[str]:
    """HF Split(behavior="Isolated"): every match and every non-empty gap between matches is a piece."""
    out, pos = [], 0
    for m in rx.finditer(s):
        out += [s[pos:m.start()]] if m.start() > pos else []
        out += [m.group()] if m.end() > m.start() else []
        pos = m.end()
    return out + [s[pos:]] if pos < len(s) else out


def _hf_bpe(ids: list[int], pairs: dict) -> tuple[list[int], int]:
    """HF's BPE on token ids: merge the lowest-ranked adjacent pair, leftmost first; also return the last rank."""
    rank = -1
    while True:
        best = None
        for i in range(len(ids) - 1):
            m = pairs.get((ids[i], ids[i + 1]))  # (rank, new id)
            if m is not None and (best is None or m < best):
                best, at = m, i
        if best is None:
            return ids, rank
        rank = best[0]
        ids[at:at + 2] = [best[1]]


def _rebuilt_in_order(merges: list[tuple[int, int, int]], byte_ids: list[int], pairs: dict) -> dict[int, int]:
    """{x: rank} for the merge results that HF's BPE of their own bytes rebuilds, for merges in training order."""
    # When every merge ranks after those that make its parts, BPE applies merges in rank order, so
    # x = a + b is rebuilt iff a and b are and nothing merges across the a|b edge first: no pair
    # (u, v) of tokens at a's right and b's left edge, while both are there, is a lower merge. right[t]
    # (left[t]) lists the tokens at t's right (left) edge during BPE(t), with the rank that made each;
    # the loop walks both lists in rank order, so it only tries pairs that are at the edge together.
    right = {t: ((t, -1),) for t in byte_ids}
    left = dict(right)
    rebuilt = {}
    for k, (a, b, x) in enumerate(merges):
        if a not in right or b not in left:
            continue  # a part is never formed, so neither is x
        ra, lb, i, j = right[a], left[b], 0, 0
        last_i, last_j = len(ra) - 1, len(lb) - 1
        while i < last_i or j < last_j:  # the last pair is (a, b) itself
            (u, made_u), (v, made_v) = ra[i], lb[j]
            gone_u = ra[i + 1][1] if i < last_i else _NEVER  # rank that replaces u at the edge
            gone_v = lb[j + 1][1] if j < last_j else _NEVER
            r = pairs.get((u, v), (_NEVER,))[0]
            if made_u < r < gone_u and made_v < r <= gone_v:  # equal ranks: the leftmost pair goes first
                break
            i, j = i + (gone_u <= gone_v), j + (gone_v <= gone_u)
        else:
            rebuilt[x] = k
            right[x], left[x] = right[b] + ((x, k),), left[a] + ((x, k),)
    return rebuilt


# ----------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """Byte-level BPE that encodes like HF tokenizers' encode(text, add_special_tokens=False)."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], added: list[dict], steps: list,
                 ignore_merges: bool = False, normalize=None):
        self.ignore_merges, self._steps, self._normalize = ignore_merges, steps, normalize
        added = [{"special": False, "lstrip": False, "rstrip": False, "single_word": False,
                  "normalized": not a.get("special", False), **a} for a in added if a["content"]]
        n_vocab = 1 + max([*vocab.values(), *(a["id"] for a in added)], default=-1)
        self._id_bytes: list[bytes | None] = [None] * n_vocab
        self._vocab_bytes: dict[bytes, int] = {}  # byte-level entries only: what a piece can equal
        for s, i in vocab.items():
            b = _unbyte(s)
            self._id_bytes[i] = s.encode() if b is None else b  # HF's ByteLevel decoder also falls back to the text
            if b is not None:
                self._vocab_bytes[b] = i
        self._build_bpe(vocab, merges)
        for a in added:  # literal text (spec §5.4); HF differs only for one spelled in the byte alphabet, e.g. "Ġx"
            self._id_bytes[a["id"]] = a["content"].encode()
        self._added_ids = {a["content"]: a["id"] for a in added}
        # HF matches tokens with normalized=false on the raw text first, then normalized=true ones
        # (their content normalized too) on what is left, after normalization.
        self._raw_added = self._added_matcher([a for a in added if not a["normalized"]], lambda s: s)
        self._norm_added = self._added_matcher([a for a in added if a["normalized"]], normalize or (lambda s: s))
        self.bos_id, self.eos_ids, self.pad_id, self.special_tokens = None, set(), None, {}

    @staticmethod
    def _added_matcher(added: list[dict], normalize) -> tuple:
        """(regex, {matched text: token}); longest first makes the alternation leftmost-longest, like HF."""
        table = {normalize(a["content"]): a for a in added}
        rx = regex.compile("|".join(regex.escape(t) for t in sorted(table, key=len, reverse=True))) if table else None
        return rx, table

    def _build_bpe(self, vocab: dict[str, int], merges: list[tuple[str, str]]):
        """A tiktoken engine whose merges are exactly HF's."""
        missing = [BYTE_TO_CHAR[b] for b in range(256) if BYTE_TO_CHAR[b] not in vocab]
        if missing:
            raise ValueError(f"the vocab lacks {len(missing)} of the 256 byte tokens (e.g. {missing[0]!r}); "
                             "flint reads byte-level BPE vocabs only")
        byte_ids = [vocab[BYTE_TO_CHAR[b]] for b in range(256)]
        for k, (a, b) in enumerate(merges):
            if a not in vocab or b not in vocab or a + b not in vocab:
                raise ValueError(f"merge {k} ({a!r}, {b!r}): a part or the result is not in the vocab; corrupt file")
        merges = [(vocab[a], vocab[b], vocab[a + b]) for a, b in merges]
        pairs = {(a, b): (k, x) for k, (a, b, x) in enumerate(merges)}  # HF: a repeated pair keeps its last rank
        made = {}
        for k, (_, _, x) in enumerate(merges):
            made.setdefault(x, k)
        # tiktoken ranks a *byte string* (any split of it may merge), HF a *pair*. HF forms x only from
        # pieces that its BPE of x's own bytes passes through (merges never cross a token's edges), so
        # both pick the same merge at every step if x gets the rank of the merge that ends HF's BPE of x,
        # and x is left out when that BPE does not rebuild it (HF never forms x; ignore_merges can still
        # emit it, through the vocab lookup in _bpe). Measured: 0.75 s for 150k merges in training order.
        if len(pairs) == len(made) == len(merges) and all(max(made.get(a, -1), made.get(b, -1)) < k
                                                          for k, (a, b, _) in enumerate(merges)):
            rebuilt = _rebuilt_in_order(merges, byte_ids, pairs)
        else:  # repeated or out-of-order merges: run HF's BPE on every result (1.5 s for 150k merges)
            rebuilt = {}
            for x in made:
                xb = self._id_bytes[x]
                if self._vocab_bytes.get(xb) == x:  # else not byte-level: no BPE path reaches it
                    out, k = _hf_bpe([byte_ids[c] for c in xb], pairs)
                    if out == [x]:
                        rebuilt[x] = k
        self._unrebuilt = set(made) - set(rebuilt)  # merge results HF never forms (inspected by the tests)
        ranks = {bytes([b]): b for b in range(256)}
        self._rank_to_id = byte_ids + [-1] * len(merges)
        for x, k in rebuilt.items():
            ranks[self._id_bytes[x]], self._rank_to_id[256 + k] = 256 + k, x
        # pat_str matches a whole piece: pieces come from our pre-tokenizer, tiktoken only merges.
        self._enc = tiktoken.Encoding("flint", pat_str=r"(?s).+", mergeable_ranks=ranks, special_tokens={})

    @classmethod
    def from_files(cls, tokenizer_json_path, tokenizer_config_path=None, generation_config_path=None, config_path=None):
        """Load tokenizer.json; special ids come from the other three files, each optional (None or absent)."""
        where = str(tokenizer_json_path)
        tj = _read_json(tokenizer_json_path, required=True)
        model = tj.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{where}: model type {model.get('type')!r} is not supported; flint reads 'BPE' only")
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
            if model.get(key) not in (None, False, ""):
                raise ValueError(f"{where}: model.{key} = {model[key]!r} is not supported; expected null")
        decoder = (tj.get("decoder") or {}).get("type", "ByteLevel")
        if decoder != "ByteLevel":
            raise ValueError(f"{where}: decoder {decoder!r} is not supported; expected ByteLevel")
        # Unicode normal forms come from Python's unicodedata; other normalizers are refused, not guessed.
        norm = tj.get("normalizer")
        if norm is not None and norm.get("type") not in _NORMAL_FORMS:
            raise ValueError(f"{where}: normalizer {norm.get('type')!r} is not supported; "
                             f"expected null or one of {', '.join(_NORMAL_FORMS)}")
        # The post_processor is ignored: as with HF add_special_tokens=False, BOS comes from the chat template.
        tok = cls(model.get("vocab") or {}, [_merge_pair(m, where) for m in model.get("merges", [])],
                  tj.get("added_tokens") or [], _pre_tokenizer_steps(tj.get("pre_tokenizer"), where),
                  bool(model.get("ignore_merges")), norm and functools.partial(unicodedata.normalize, norm["type"]))

        tc, gc, cc = (_read_json(p) or {} for p in (tokenizer_config_path, generation_config_path, config_path))

        def ids(key):  # tokenizer_config's "<key>_token" (string or AddedToken dict), then each "<key>_token_id"
            text = tc.get(f"{key}_token")
            text = text.get("content") if isinstance(text, dict) else text
            found = [] if text is None else [tok.token_to_id(text)]
            if None in found:
                raise ValueError(f"{tokenizer_config_path}: {key}_token {text!r} is no token of {where}; fix or drop")
            for cfg, path in ((gc, generation_config_path), (cc, config_path)):
                v = cfg.get(f"{key}_token_id")
                v = [] if v is None else [v] if isinstance(v, int) else v
                if not (isinstance(v, list) and all(isinstance(i, int) for i in v)):
                    raise ValueError(f"{path}: {key}_token_id {v!r} is not an int or a list of ints")
                found += v
            return found

        # Stop set = the union (spec §5); bos and pad take the first found.
        bos, pad = ids("bos"), ids("pad")
        tok._set_specials(bos[0] if bos else None, ids("eos"), pad[0] if pad else None)
        return tok

    @classmethod
    def from_gguf_fields(cls, tokens: list[str], token_types: list[int], merges: list[str], bos_id, eos_ids, pre: str,
                         pad_id=None):
        """From GGUF tokenizer.ggml.* metadata (model "gpt2"); types 3 control and 4 user-defined are added tokens."""
        if pre != "flint":
            raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; flint knows 'flint' (spec §5)")
        if len(token_types) != len(tokens):
            raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types; the file is corrupt")
        # HF -> GGUF conversion writes special added tokens as control, the others as user-defined; matching
        # user-defined ones second keeps HF's order (special tokens are normalized=false, the others true).
        added = [{"id": i, "content": t, "special": ty == 3, "normalized": ty == 4}
                 for i, (t, ty) in enumerate(zip(tokens, token_types, strict=True)) if ty in (3, 4)]
        steps = [regex.compile(p) for p in FLINT_SPLITS]  # flint's ByteLevel adds no prefix space and no regex
        tok = cls({t: i for i, t in enumerate(tokens)}, [_merge_pair(m, "GGUF tokenizer.ggml.merges") for m in merges],
                  added, steps)
        bos_id, pad_id = (None if i is None else int(i) for i in (bos_id, pad_id))  # GGUF readers give numpy ints
        tok._set_specials(bos_id, [int(i) for i in eos_ids], pad_id)
        return tok

    @classmethod
    def byte_level(cls, special_tokens: list[str], eos_token: str | None = None):
        """Ids 0..255 are the bytes, then special_tokens; no merges. For the random tiny demo model."""
        specials = [{"id": 256 + i, "content": s, "special": True} for i, s in enumerate(special_tokens)]
        tok = cls({BYTE_TO_CHAR[b]: b for b in range(256)}, [], specials, [])
        tok._set_specials(None, [] if eos_token is None else [tok.token_to_id(eos_token)], None)
        return tok

    def _set_specials(self, bos_id, eos_ids: list, pad_id):
        """Check and keep bos/eos/pad ids, and their text for templates (bos_token, eos_token, pad_token)."""
        for tid in [bos_id, pad_id, *eos_ids]:
            if tid is not None and not (isinstance(tid, int) and 0 <= tid < self.n_vocab and self._id_bytes[tid]):
                raise ValueError(f"special token id {tid!r} is not one of the tokenizer's {self.n_vocab} ids; "
                                 "check generation_config.json, config.json or the GGUF metadata")
        self.bos_id, self.eos_ids, self.pad_id = bos_id, set(eos_ids), pad_id
        named = {"bos_token": bos_id, "eos_token": eos_ids[0] if eos_ids else None, "pad_token": pad_id}
        self.special_tokens = {k: self.decode([tid]) for k, tid in named.items() if tid is not None}

    @property
    def n_vocab(self) -> int:
        """Number of ids the tokenizer can produce (max id + 1)."""
        return len(self._id_bytes)

    def token_to_id(self, text: str) -> int | None:
        """Id of an added token (by content) or of a vocab token (by its text), else None."""
        return self._added_ids.get(text, self._vocab_bytes.get(text.encode()))

    def token_bytes(self, tid: int) -> bytes:
        """The bytes one token stands for."""
        b = self._id_bytes[tid] if 0 <= tid < len(self._id_bytes) else None
        if b is None:
            raise ValueError(f"token id {tid} is not in the tokenizer ({self.n_vocab} ids); mask it out of the logits")
        return b

    def decode(self, ids) -> str:
        """Text of ids; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Ids of text; allow_special=False reads special-token text as plain text (other added tokens still match)."""
        ids = []
        for seg, tid in self._split_added(text, allow_special):
            if tid is not None:
                ids.append(tid)
            else:
                for piece in self._pre_tokenize(seg):
                    ids += self._bpe(piece)
        return ids

    def _split_added(self, text: str, allow_special: bool) -> list[tuple[str, int | None]]:
        """Cut added tokens out of text: [(segment, id or None)], like HF AddedVocabulary.extract_and_normalize."""
        out = []
        for seg, tid in self._find_added(text, *self._raw_added, allow_special):
            if tid is not None:
                out.append((seg, tid))
            else:
                seg = self._normalize(seg) if self._normalize else seg
                out += self._find_added(seg, *self._norm_added, allow_special)
        return out

    @staticmethod
    def _find_added(s: str, rx, table: dict, allow_special: bool) -> list[tuple[str, int | None]]:
        """One AddedVocabulary pass: matches become tokens, honouring single_word, lstrip and rstrip."""
        out, done = [], 0  # done = end of the last token taken; lstrip never reaches back past it
        for m in rx.finditer(s) if rx else ():
            a, start, stop = table[m.group()], m.start(), m.end()
            if a["special"] and not allow_special:
                continue
            word_next = (start > 0 and _WORD.match(s[start - 1])) or (stop < len(s) and _WORD.match(s[stop]))
            if a["single_word"] and word_next:
                continue
            while a["lstrip"] and start > 0 and _SPACE.match(s[start - 1]):
                start -= 1
            while a["rstrip"] and stop < len(s) and _SPACE.match(s[stop]):
                stop += 1
            start = max(start, done) if a["lstrip"] else start
            out += [(s[done:start], None)] if start > done else []
            out.append((s[start:stop], a["id"]))
            done = stop
        return out + [(s[done:], None)] if done < len(s) else out

    def _pre_tokenize(self, text: str) -> list[str]:
        """Pieces of text: each step runs on every piece of the one before (spec §5)."""
        pieces = [text]
        for step in self._steps:
            if step is _PREFIX_SPACE:
                pieces = [p if p.startswith(" ") else " " + p for p in pieces]
            else:
                pieces = [q for p in pieces for q in _split_isolated(step, p)]
        return pieces

    def _bpe(self, piece: str) -> list[int]:
        """Ids of one pre-tokenized piece."""
        if self.ignore_merges:  # HF takes a piece that is itself a vocab token as is, skipping the merges
            tid = self._vocab_bytes.get(piece.encode())
            if tid is not None:
                return [tid]
        return [self._rank_to_id[r] for r in self._enc.encode_ordinary(piece)]


class StreamDecoder:
    """Decode ids one at a time, holding back the bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        """Text completed by this token (maybe empty)."""
        return self._utf8.decode(self.tokenizer.token_bytes(int(tid)))

    def flush(self) -> str:
        """Whatever is held back, as U+FFFD since it never became a character."""
        return self._utf8.decode(b"", final=True)


# ----------------------------------------------------------------------------
# Chat template (spec §6): render the checkpoint's own Jinja template the way transformers 5.23 does.

# For the random tiny demo model only, whose byte_level tokenizer has these specials. Real
# checkpoints always use their own template (find_chat_template); never hand-write one for them.
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' ~ m.role) }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (raise_exception) or could not be parsed or rendered."""


def find_chat_template(checkpoint_dir) -> str | None:
    """The checkpoint's template: chat_template.jinja, else tokenizer_config.json["chat_template"]; None if neither."""
    d = Path(checkpoint_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = (_read_json(d / "tokenizer_config.json") or {}).get("chat_template")
    if isinstance(template, list):  # named templates [{name, template}]: the chat one is "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{d / 'tokenizer_config.json'}: chat_template names {sorted(map(str, named))} "
                             "but no 'default'; add a chat_template.jinja")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{d / 'tokenizer_config.json'}: chat_template is a {type(template).__name__}, not a string")
    return template


def _raise_exception(message):
    """Template global: the template's own refusal (e.g. roles out of order)."""
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: json.dumps with its options, without the HTML escaping of Jinja's own."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    """Compile once per template text, in transformers' sandboxed environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, tokenizer=None,
                **kwargs) -> str:
    """Render messages with a chat template; kwargs (tools, thinking switches, ...) pass through as variables."""
    variables = {"tools": None, **(tokenizer.special_tokens if tokenizer is not None else {}), **kwargs}
    try:
        return _compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


# -----------------------------------------------------------------------------
# Checkpoint resolution and the top-level load

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.gguf"]
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}   # Flint's recommendation (spec §6)


@dataclass
class Checkpoint:
    model: flint.Transformer
    tokenizer: "Tokenizer"
    chat_template: str | None
    sampling: dict                          # temperature, top_p, top_k: generation_config.json or the defaults
    name: str


def resolve_checkpoint(name):
    """A local directory, or an HF repo id (e.g. RecursiveSI/flint) from the HF cache or downloaded."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"checkpoint {name!r}: no such file or directory; pass a local checkpoint "
                                f"directory, an HF repo id such as RecursiveSI/flint, or 'tiny'")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"checkpoint {name!r} is not a local path and huggingface_hub is not installed to "
                                f"download it; pip install huggingface_hub, or download the repo and pass its "
                                f"directory") from None
    try:                                                                # the local HF cache first, then the hub
        return Path(snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=True))
    except Exception:
        pass
    try:
        print(f"downloading {name} from the Hugging Face hub (BF16 Flint is about 80 GB)", file=sys.stderr)
        return Path(snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:
        raise FileNotFoundError(
            f"checkpoint {name!r} is not in the local HF cache and could not be downloaded ({type(e).__name__}: "
            f"{e}). On a machine with network: huggingface-cli download {name} --local-dir DIR, then pass "
            f"--checkpoint DIR") from None


def load(checkpoint, device="cpu", dtype=torch.bfloat16, progress=True):
    """Model, tokenizer, chat template and sampling defaults from a checkpoint directory (BF16 or ModelOpt NVFP4
    safetensors, or one .gguf), a .gguf file, an HF repo id or 'tiny'."""
    if checkpoint == "tiny":
        return load_tiny(device, dtype)
    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(checkpoint)
    gguf_file = find_gguf(ckpt)
    if gguf_file is not None:
        ckpt = gguf_file
        model, tokenizer, template, sampling = load_gguf(gguf_file, device, dtype, progress)
    else:
        model, tokenizer, template, sampling = load_hf_dir(ckpt, device, dtype, progress)
    print(summary(ckpt.name, model, time.perf_counter() - t0), file=sys.stderr)
    return Checkpoint(model, tokenizer, template, sampling, str(ckpt))


def find_gguf(ckpt):
    """The GGUF file to load: ckpt itself, or the one .gguf of a directory without safetensors; None otherwise."""
    if ckpt.is_file():
        if ckpt.suffix != ".gguf":
            raise ValueError(f"checkpoint {ckpt}: expected a directory (config.json and safetensors) or a .gguf file")
        return ckpt
    if any(ckpt.glob("*.safetensors")):
        return None
    found = sorted(ckpt.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"checkpoint {ckpt}: {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}); "
                         f"pass the one to load (split GGUF files are not supported: merge them with "
                         f"llama-gguf-split --merge)")
    return found[0] if found else None


def _maybe(path):
    return path if path.exists() else None


def load_tiny(device="cpu", dtype=torch.float32):
    """A small random-weight Flint with a byte-level tokenizer, built offline: it runs the whole pipeline, and its
    output is gibberish."""
    tokenizer = Tokenizer.byte_level(TINY_SPECIAL_TOKENS, eos_token="<|end|>")
    tokenizer.eos_ids.add(tokenizer.token_to_id("<|endoftext|>"))
    cfg = flint.Config(vocab_size=tokenizer.n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, sliding_window=33,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096)
    model = flint.init_random(flint.Transformer(cfg, dtype, device), seed=0)
    print(f"{summary('tiny', model, 0)}\ntiny is a RANDOM-weight Flint: it runs the whole pipeline and writes "
          f"gibberish", file=sys.stderr)
    return Checkpoint(model, tokenizer, TINY_CHAT_TEMPLATE, dict(SAMPLING_DEFAULTS), "tiny")


def _count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def summary(name, model, seconds):
    n = n4 = 0
    for _, w in model.weights():
        n += w.shape.numel()
        n4 += w.shape.numel() if isinstance(w, flint.NVFP4) else 0
    nvfp4 = f" ({_count(n4)} in NVFP4)" if n4 else ""
    gpu, host = peak_memory_gib(model.device)
    mem = f"{gpu:.1f} GiB GPU peak, " if gpu is not None else ""
    return (f"loaded {name}: {_count(n)} parameters{nvfp4}, {model.dtype}, {model.device}, {seconds:.1f} s, "
            f"{mem}{host:.1f} GiB host peak")


def peak_memory_gib(device):
    """(peak GPU memory allocated on device, or None off CUDA; peak host RSS of this process), in GiB."""
    gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return gpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # Linux reports KiB
