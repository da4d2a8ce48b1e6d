"""Checkpoints for flint.py: HF BF16 safetensors directories, the tokenizer and the chat template.

Every format is read lazily (memory-mapped) and streamed into the model's preallocated tensors one checkpoint tensor
at a time, so no second copy of the weights ever exists in host memory. Layout work (fusing q/k/v and gate/up,
stacking experts) happens here, in plain functions; flint.py never sees checkpoint names. Errors name the file or
tensor, what was expected, what was found and what to do.
"""
import codecs
import datetime
import functools
import json
import resource
import sys
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import jinja2
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
# Keys whose value, when present, must be this one: anything else is math flint.py does not implement
FIXED_VALUES = {"model_type": "flint", "hidden_act": "silu", "attention_bias": False, "use_sliding_window": True,
                "router_score_function": "sigmoid", "softmax_type": "learnable", "rope_scaling": None,
                "quantization_config": None}


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
# HF safetensors names -> flint parameters (spec §4a)
#
# flint parameter -> HF tensor name(s); per layer under "model.layers.{L}.". A list fills the parameter's rows in
# order (q/k/v into qkv, gate/up into gate_up), and "{E}" names one expert of a stacked [E, ...] parameter.

HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn.qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.o": "self_attn.o_proj.weight",
    "attn.q_norm": "self_attn.q_norm.weight",
    "attn.k_norm": "self_attn.k_norm.weight",
    "attn.sinks": "self_attn.softmax_offset",                           # no ".weight"
}
HF_DENSE = {"ffn.gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "ffn.down": "mlp.down_proj.weight"}
HF_MOE = {
    "ffn.router": "mlp.gate.weight",
    "ffn.gate_up": ["mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"],
    "ffn.down": "mlp.experts.{E}.down_proj.weight",
    "ffn.shared_gate_up": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
    "ffn.shared_down": "mlp.shared_expert.down_proj.weight",
}
# transformers' in-memory names, which some exports write instead: one tensor for the whole parameter
HF_ALIASES = {"attn.sinks": "self_attn.sinks", "ffn.gate_up": "mlp.experts.gate_up_proj",
              "ffn.down": "mlp.experts.down_proj"}
HF_IGNORED = ("rotary_emb.inv_freq",)                                   # recomputed from rope_theta


def hf_pieces(cfg, name, param, available):
    """The (view of `param`, HF tensor name) pairs that together fill flint parameter `name` exactly."""
    if name in HF_GLOBAL:
        return [(param, HF_GLOBAL[name])]
    _, L, key = name.split(".", 2)
    prefix = f"model.layers.{L}."
    if key in HF_ALIASES and prefix + HF_ALIASES[key] in available:
        return [(param, prefix + HF_ALIASES[key])]
    names = {**HF_LAYER, **(HF_MOE if cfg.is_moe(int(L)) else HF_DENSE)}[key]
    names = [names] if isinstance(names, str) else names
    stacked = "{E}" in names[0]
    pieces = []
    for e in range(cfg.num_experts if stacked else 1):
        dst = param[e] if stacked else param
        if key == "attn.qkv":
            H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            parts = dst.split([H * D, G * D, G * D])
        else:                                                           # gate/up halves, or the whole tensor
            parts = dst.chunk(len(names))
        pieces += [(p, prefix + n.replace("{E}", str(e))) for p, n in zip(parts, names)]
    return pieces


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


def load_hf_weights(model, files, progress=True):
    """Stream every tensor of an HF checkpoint into the model's preallocated parameters, shard by shard."""
    cfg = model.cfg
    plan = {}                                                           # shard -> [(dst, HF name, flint name)]
    for name, param in model.weights():
        for dst, hf in hf_pieces(cfg, name, param.data, files):
            if hf not in files:
                raise ValueError(f"checkpoint: tensor {hf} (for flint {name}) is missing; the checkpoint is "
                                 f"incomplete or not a Flint model with this config.json")
            plan.setdefault(files[hf], []).append((dst, hf, name))
    used = {hf for items in plan.values() for _, hf, _ in items}
    unused = sorted(n for n in files if n not in used and not n.endswith(HF_IGNORED))
    if unused:
        raise ValueError(f"checkpoint: {len(unused)} unexpected tensors, e.g. {unused[:5]}; flint.py would ignore "
                         f"them, so the checkpoint is not the Flint model its config.json describes")
    total = sum(d.numel() * d.element_size() for items in plan.values() for d, _, _ in items)
    bar = _progress(total, progress)
    for shard, items in plan.items():
        with _open_safetensors(shard) as f:
            for dst, hf, name in items:
                try:
                    t = f.get_tensor(hf)
                except SafetensorError as e:
                    raise ValueError(f"{shard}: cannot read tensor {hf} ({e}); the file is corrupt: download it "
                                     f"again") from None
                if t.shape != dst.shape:
                    raise ValueError(f"{shard}: tensor {hf} has shape {list(t.shape)}, expected {list(dst.shape)} "
                                     f"from config.json; the config does not match the weights")
                if not t.is_floating_point():
                    raise ValueError(f"{shard}: tensor {hf} has dtype {t.dtype}, expected a float type (BF16/F32)")
                dst.copy_(t)                                            # host -> device, with the dtype cast
                bar.update(dst.numel() * dst.element_size())
    bar.close()


def _progress(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr,
                disable=not enabled or None, leave=False)


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

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
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
    """Model, tokenizer, chat template and sampling defaults from a checkpoint directory, an HF repo id or 'tiny'."""
    if checkpoint == "tiny":
        return load_tiny(device, dtype)
    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(checkpoint)
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint {ckpt}: expected a directory with config.json and safetensors")
    cfg = config_from_hf(_read_json(ckpt / "config.json", required=True), str(ckpt / "config.json"))
    files = safetensors_files(ckpt)
    tokenizer = Tokenizer.from_files(ckpt / "tokenizer.json", _maybe(ckpt / "tokenizer_config.json"),
                                     _maybe(ckpt / "generation_config.json"), ckpt / "config.json")
    if tokenizer.n_vocab > cfg.vocab_size:
        raise ValueError(f"{ckpt / 'tokenizer.json'}: token ids reach {tokenizer.n_vocab - 1}, beyond the model's "
                         f"vocab_size {cfg.vocab_size}; the tokenizer does not belong to this checkpoint")
    model = flint.Transformer(cfg, dtype, device)
    load_hf_weights(model, files, progress)
    gen = _read_json(ckpt / "generation_config.json") or {}
    sampling = {k: gen.get(k, v) for k, v in SAMPLING_DEFAULTS.items()}
    print(summary(ckpt.name, model, time.perf_counter() - t0), file=sys.stderr)
    return Checkpoint(model, tokenizer, find_chat_template(ckpt), sampling, str(ckpt))


def _maybe(path):
    return path if path.exists() else None


def load_tiny(device="cpu", dtype=torch.float32):
    """A small random-weight Flint with a byte-level tokenizer, built offline: it runs the whole pipeline, and its
    output is gibberish."""
    tokenizer = Tokenizer.byte_level(TINY_SPECIAL_TOKENS, eos_token="<|end|>")
    tokenizer.eos_ids.add(tokenizer.token_to_id("<|endoftext|>"))
    cfg = flint.Config(vocab_size=tokenizer.n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, sliding_window=33,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096)
    model = flint.init_random(flint.Transformer(cfg, dtype, device), seed=0)
    print(f"{summary('tiny', model, 0)}\ntiny is a RANDOM-weight Flint: it runs the whole pipeline and writes "
          f"gibberish", file=sys.stderr)
    return Checkpoint(model, tokenizer, TINY_CHAT_TEMPLATE, dict(SAMPLING_DEFAULTS), "tiny")


def _count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def summary(name, model, seconds):
    n = sum(p.numel() for p in model.parameters())
    if model.device.type == "cuda":
        mem = f"{torch.cuda.max_memory_allocated(model.device) / 2**30:.1f} GiB GPU peak, "
    else:
        mem = ""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB -> GiB (Linux)
    return (f"loaded {name}: {_count(n)} parameters, {model.dtype}, {model.device}, {seconds:.1f} s, "
            f"{mem}{host:.1f} GiB host peak")
