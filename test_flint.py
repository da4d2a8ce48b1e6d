"""Tests: flint.py against the transformers oracle, the KV cache, sampling, the loaders, the tokenizer and the CLI.

CPU tests build tiny checkpoints themselves (no weights are downloaded); GPU tests skip without CUDA.
Run: python -m pytest -q test_flint.py
"""
# ruff: noqa: E402 (TRITON_INTERPRET must be set before triton is imported)
import concurrent.futures
import copy
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():                                       # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")                      # (set before triton is imported)

import gguf
import numpy as np
import pytest
import tokenizers
import triton
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

import flint
import kernels
import load
from load import (BYTE_TO_CHAR, FLINT_SPLITS, TINY_CHAT_TEMPLATE, TINY_SPECIAL_TOKENS, ChatTemplateError, StreamDecoder,
                  Tokenizer, _hf_bpe, _rebuilt_in_order, find_chat_template, render_chat)

HERE = Path(__file__).parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _patch_lang_once():
    """Triton's interpreter patches triton.language again at every call of a @triton.jit helper inside a kernel
    (inspect.getmembers over its modules, about half a millisecond per call), although the modules that the
    helper sees were patched by the launch or an earlier call: a third of this suite's time on 2 cores. Here a
    call inside a launch patches only modules not yet patched in it; the launch's own patch and undo are
    unchanged. An interpreter without these names runs as it is."""
    from triton.runtime import interpreter
    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope")):
        return
    patch, langs, active = interpreter._patch_lang, {}, []              # active: [modules patched in the launch]

    def patch_once(fn):
        if fn not in langs:                                             # (the modules _patch_lang looks for)
            langs[fn] = {id(v) for v in fn.__globals__.values() if v is kernels.tl or v is kernels.tl.core}
        if active and langs[fn] <= active[0]:
            return interpreter._LangPatchScope()                        # nothing patched, nothing to undo
        scope = patch(fn)
        if active:                                                      # a helper's call: patched until the
            active[0] |= langs[fn]                                      # launch ends, as before
            return scope
        active.append(set(langs[fn]))
        undo = scope.restore

        def restore():
            active.clear()
            undo()
        scope.restore = restore
        return scope
    interpreter._patch_lang = patch_once


if kernels.INTERPRET:
    _patch_lang_once()

# -----------------------------------------------------------------------------
# Tiny checkpoints written by transformers itself (the oracle, spec §8)

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, sliding_window=5, max_position_embeddings=512)
LAYOUTS = {
    "hf-rule": {},                                                      # full at 0, 1, 5; sliding at 2, 3, 4
    "gqa4-top3": dict(num_attention_heads=8, num_key_value_heads=2, num_experts_per_tok=3, mlp_only_layers=[0],
                      layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                   "sliding_attention", "full_attention", "sliding_attention"],
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "mha-sparse-step": dict(num_hidden_layers=4, num_key_value_heads=4, decoder_sparse_step=2, mlp_only_layers=[],
                            num_experts_per_tok=4, sliding_window=3, norm_topk_prob=False),
}


def hf_model(**overrides):
    from transformers import FlintConfig, FlintForCausalLM
    torch.manual_seed(0)
    config = FlintConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = FlintForCausalLM(config).eval()
    with torch.no_grad():                                               # HF inits sinks N(0, 0.02): make them O(1)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    return model


def save_hf(model, path, shard="60KB", tokenizer=True):
    model.save_pretrained(path, max_shard_size=shard)
    if tokenizer:
        write_tokenizer(path, vocab_size=model.config.vocab_size)
    return path


def write_tokenizer(path, vocab_size=320, eos="<|endoftext|>"):
    """A small byte-level BPE tokenizer.json with Flint's pre-tokenizer, trained by the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = flint_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[eos, "<|user|>", "<|assistant|>", "<think>", "</think>"],
                                  show_progress=False)
    tok.train_from_iterator(SAMPLES * 4, trainer)
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tok


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    model = hf_model()
    return model, save_hf(model, tmp_path_factory.mktemp("hf_tiny"))


def flint_from(path, dtype=torch.float32, device="cpu"):
    return load.load(str(path), device, dtype, progress=False).model


# -----------------------------------------------------------------------------
# The reference model against transformers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(layout, tmp_path):
    hf = hf_model(**LAYOUTS[layout])
    model = flint_from(save_hf(hf, tmp_path, shard="40KB" if layout == "hf-rule" else "10MB"))
    T = 3 * hf.config.sliding_window + 4                                # well past the window
    ids = torch.randint(0, hf.config.vocab_size, (2, T))
    with torch.no_grad():
        want = hf(ids).logits
    got = model(ids, torch.arange(T)[None].expand(2, T))
    assert (got - want).abs().max() <= 1e-4


def test_bf16_close_to_transformers(hf_tiny):
    """bf16: the serving numerics differ from HF eager by about one bf16 ulp per op (spec §2.8)."""
    hf, path = hf_tiny
    model = flint_from(path, torch.bfloat16)
    ids = torch.randint(0, 320, (1, 24))
    with torch.no_grad():
        want = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()
    got = model(ids, torch.arange(24)[None])
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_cached_decode_equals_recompute(hf_tiny):
    """Prefill then single-token steps, and chunked prefill, across several wraps of the sliding ring."""
    model = flint_from(hf_tiny[1])
    cfg, T = model.cfg, 29                                              # window 5: the ring wraps 5 times
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    pos = torch.arange(T)[None].expand(2, T)
    full = model(ids, pos)
    cache = flint.KVCache(cfg, 2, 40, torch.float32, "cpu")
    steps = [model(ids[:, :7], pos[:, :7], cache)] + [model(ids[:, t:t + 1], pos[:, t:t + 1], cache)
                                                      for t in range(7, T)]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5
    # the same cache again from position 0: what the first pass left must be invisible
    chunks = [model(ids[:, a:b], pos[:, a:b], cache) for a, b in [(0, 3), (3, 11), (11, 12), (12, T)]]
    assert (torch.cat(chunks, 1) - full).abs().max() <= 1e-5
    # attention scores in blocks of a few queries (what a long context does to a prefill chunk)
    budget, flint.SCORES_BUDGET = flint.SCORES_BUDGET, 2 * 4 * 40                # 2 rows x 4 heads x 40 keys
    try:
        chunks = [model(ids[:, a:b], pos[:, a:b], cache) for a, b in [(0, 11), (11, T)]]
    finally:
        flint.SCORES_BUDGET = budget
    assert (torch.cat(chunks, 1) - full).abs().max() <= 1e-5


def test_cache_rows_of_different_lengths(hf_tiny):
    """Rows prefilled separately (prompts of different lengths) then decoded together equal each row alone."""
    model = flint_from(hf_tiny[1])
    cfg = model.cfg
    a, b = torch.randint(0, cfg.vocab_size, (1, 13)), torch.randint(0, cfg.vocab_size, (1, 4))
    cache = flint.KVCache(cfg, 2, 32, torch.float32, "cpu")
    model(a[:, :-1], torch.arange(12)[None], cache.row(0))
    model(b[:, :-1], torch.arange(3)[None], cache.row(1))
    step = model(torch.cat([a[:, -1:], b[:, -1:]]), torch.tensor([[12], [3]]), cache)
    assert (step[0, -1] - model(a, torch.arange(13)[None])[0, -1]).abs().max() <= 1e-5
    assert (step[1, -1] - model(b, torch.arange(4)[None])[0, -1]).abs().max() <= 1e-5


def test_kv_cache_size():
    """Full Flint: 28 KiB per token on the 14 full layers, plus about 35 MiB of sliding rings (spec §3)."""
    cfg = flint.Config(rope_theta=10000.0)
    n = 4096
    cache = flint.KVCache(cfg, 1, n, torch.bfloat16, "meta")
    shapes = [tuple(k.shape) for k in cache.k]
    assert shapes.count((1, n, 4, 128)) == 14 and shapes.count((1, 513, 4, 128)) == 35
    per_token, rings = 14 * 2 * 4 * 128 * 2, 35 * 513 * 2 * 4 * 128 * 2
    assert per_token == 28 * 1024 and cache.nbytes == n * per_token + rings
    assert 35 * 2**20 < rings < 36 * 2**20


# -----------------------------------------------------------------------------
# Reference ops


def test_routing_ties_go_to_lowest_index():
    logits = torch.zeros(2, 8)
    logits[:, [1, 3, 5, 6]] = 1.0                                       # four equal best experts
    w, e = flint.route_ref(logits, top_k=3, norm_topk_prob=True)
    assert e.tolist() == [[1, 3, 5]] * 2
    assert torch.allclose(w.sum(-1), torch.ones(2))


def test_sink_attention_sinks_and_window():
    """One key, sink s: the weight on the key is exp(score) / (exp(score) + exp(s)); the window hides old keys."""
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    sinks = torch.tensor([0.5, -2.0])
    q_pos, k_pos = torch.tensor([[2]]), torch.tensor([[0, 1, 2]])
    o = flint.sink_attention_ref(q, k, v, sinks, q_pos, k_pos, window=1)     # only the key at position 2
    score = (q[0, 0] @ k[0, 2, 0]) / 2                                  # D = 4: scale 1/2
    p = torch.exp(score) / (torch.exp(score) + torch.exp(sinks))        # [2] per head
    assert torch.allclose(o[0, 0], p[:, None] * v[0, 2, 0], atol=1e-6)
    full = flint.sink_attention_ref(q, k, v, sinks, q_pos, k_pos, window=0)
    empty = flint.sink_attention_ref(q, k, v, sinks, q_pos, torch.full((1, 3), -1), window=0)
    assert not torch.allclose(full, o) and empty.abs().max() == 0


def test_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert flint.sample(logits, temperature=0).tolist() == [1]
    probs = flint.logits_to_probs(logits, 1.0, top_k=2)
    assert (probs[0, [0, 2]] == 0).all() and torch.allclose(probs.sum(), torch.tensor(1.0))
    probs = flint.logits_to_probs(logits, 1.0, top_p=0.5)              # the top token alone holds 64%
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    torch.manual_seed(0)
    draws = flint.sample(logits.expand(4000, 4), 1.0)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    draws = flint.sample(logits.expand(4000, 4), 1.0, top_k=2)            # only ids 1 and 3, as e^3 : e^2
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, flint.logits_to_probs(logits, 1.0, top_k=2)[0], atol=0.03) and freq[[0, 2]].sum() == 0
    draws = flint.sample(logits.expand(100, 4), 1.0, top_k=3, top_p=0.5)  # top-p after top-k: the top token only
    assert (draws == 1).all()


def test_config_validation():
    with pytest.raises(ValueError, match="rope_theta"):
        flint.Config()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        flint.Config(rope_theta=1e4, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="no_rope_layer_indices"):
        flint.Config(rope_theta=1e4, no_rope_layer_indices=[])
    with pytest.raises(ValueError, match="layer_types"):
        flint.Config(rope_theta=1e4, layer_types=["sliding_attention"] * 3)
    with pytest.raises(ValueError, match="not supported"):
        flint.Config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    assert flint.Config(rope_theta=1e4).no_rope_layer_indices == [0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48]


# -----------------------------------------------------------------------------
# Loader errors: each bad input names what is wrong


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def ckpt_copy(hf_tiny, tmp_path):
    import shutil
    return Path(shutil.copytree(hf_tiny[1], tmp_path / "ckpt"))


def test_error_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load.load(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load.load(str(tmp_path))


def test_error_not_cached_offline(monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-flint-test-cache")
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        load.resolve_checkpoint("RecursiveSI/not-a-real-flint")


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama"), "model_type is 'llama'"),
    (dict(num_experts=None), r"missing keys \['num_experts'\]"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_size=128), "has shape"),
    (dict(num_hidden_layers=7), "layer_types"),
    (dict(rope_parameters=None), "rope_theta"),
])
def test_error_bad_config(ckpt_copy, change, message):
    _edit_config(ckpt_copy, **change)
    with pytest.raises(ValueError, match=message):
        load.load(str(ckpt_copy), progress=False)


def _rewrite_tensors(path, fn):
    """Apply fn to the tensor dict of every shard (fn edits it in place)."""
    from safetensors.torch import load_file, save_file
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        fn(tensors)
        save_file(tensors, path / shard, metadata={"format": "pt"})
        for name in tensors:
            index["weight_map"][name] = shard
    index["weight_map"] = {n: s for n, s in index["weight_map"].items()
                           if n in load_file(path / s)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_error_missing_tensor(ckpt_copy):
    _rewrite_tensors(ckpt_copy, lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight", None))
    with pytest.raises(ValueError, match=r"model.layers.3.mlp.experts.5.up_proj.weight .* missing"):
        load.load(str(ckpt_copy), progress=False)


def test_error_unexpected_tensor(ckpt_copy):
    _rewrite_tensors(ckpt_copy, lambda t: t.update({"model.layers.2.mlp.gate.e_score_correction_bias": torch.zeros(8)})
                     if "model.layers.2.mlp.gate.weight" in t else None)
    with pytest.raises(ValueError, match="unexpected tensors.*e_score_correction_bias"):
        load.load(str(ckpt_copy), progress=False)


def test_error_truncated_and_missing_shard(ckpt_copy):
    shards = sorted(ckpt_copy.glob("*.safetensors"))
    os.truncate(shards[1], shards[1].stat().st_size - 7)
    with pytest.raises(ValueError, match=f"{shards[1].name}.*truncated or corrupt"):
        load.load(str(ckpt_copy), progress=False)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"{shards[1].name}: listed in"):
        load.load(str(ckpt_copy), progress=False)


def test_error_corrupt_json(ckpt_copy):
    (ckpt_copy / "model.safetensors.index.json").write_text("{ not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        load.load(str(ckpt_copy), progress=False)


def test_loads_single_file_and_hf_internal_names(hf_tiny, tmp_path):
    """model.safetensors without an index, with transformers' fused expert names and `sinks`, loads the same."""
    from safetensors.torch import save_file
    hf, path = hf_tiny
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}     # gate_up_proj [E, 2I, C], sinks
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    a, b = flint_from(path), flint_from(tmp_path)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


# -----------------------------------------------------------------------------
# generate.py


def run_generate(*args, stdin=None):
    r = subprocess.run([sys.executable, str(HERE / "generate.py"), *args], capture_output=True, text=True,
                       input=stdin, timeout=300)
    return r


def test_generate_greedy_matches_transformers(hf_tiny):
    hf, path = hf_tiny
    r = run_generate("-c", str(path), "-p", "def fib(n):", "-n", "40", "-t", "0", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with torch.no_grad():
        want = hf.generate(torch.tensor([out["prompt_tokens"]]), max_new_tokens=40, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(out["prompt_tokens"]):].tolist()
    assert len(out["tokens"]) == 40 and out["tokens"] == want
    assert set(out["stats"]) >= {"prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_memory_gib"}


def test_generate_tiny_cli():
    r = run_generate("--checkpoint", "tiny", "--prompt", "hi", "-n", "16")
    assert r.returncode == 0, r.stderr
    assert "RANDOM" in r.stderr and "decode" in r.stderr and "tok/s" in r.stderr
    r = run_generate("-c", "tiny", "-p", "-", "-n", "8", "-t", "0", "--json", "--chat", stdin="hello\nthere")
    out = json.loads(r.stdout)
    assert len(out["tokens"]) <= 8 and out["stats"]["prompt_tokens"] == len(out["prompt_tokens"])


def test_generate_batch_prompt_file(tmp_path):
    """Each line is a prompt; the batch gives each prompt the tokens it gets alone (greedy)."""
    (tmp_path / "p.txt").write_text("first prompt\nsecond, longer prompt\n")
    batch = run_generate("-c", "tiny", "--prompt-file", str(tmp_path / "p.txt"), "-n", "12", "-t", "0", "--json")
    outs = [json.loads(line) for line in batch.stdout.splitlines()]
    alone = [json.loads(run_generate("-c", "tiny", "-p", p, "-n", "12", "-t", "0", "--json").stdout)
             for p in ["first prompt", "second, longer prompt"]]
    assert [o["tokens"] for o in outs] == [a["tokens"] for a in alone]
    (tmp_path / "many.txt").write_text("hi\n" * 65)
    r = run_generate("-c", "tiny", "--prompt-file", str(tmp_path / "many.txt"))
    assert r.returncode != 0 and "holds 65 prompts, and one batch decodes at most 64" in r.stderr


def test_generate_too_long_prompt():
    r = run_generate("-c", "tiny", "-p", "x" * 100, "-n", "50", "--max-seq-len", "64")
    assert r.returncode != 0 and "exceeds --max-seq-len 64" in r.stderr
    r = run_generate("-c", "tiny", "-p", "hi", "--max-seq-len", "100000")
    assert r.returncode != 0 and "exceeds the model's context" in r.stderr


def test_generate_rejects_bad_settings(hf_tiny, tmp_path):
    """Out-of-range flags and unusable devices fail before the checkpoint loads, naming the flag and what it takes;
    a checkpoint's out-of-range sampling default fails naming it and the flag that overrides it; bench.py checks its
    batches and says when there is no GPU."""
    import generate
    for flags, msg in ((["-n", "0"], "--max-new-tokens 0: expected 1 or more"),
                       (["--max-seq-len", "0"], "--max-seq-len 0: expected 2 or more"),
                       (["-t", "-1"], "--temperature -1.0: expected 0 (greedy) or more"),
                       (["--top-k", "-3"], "--top-k -3: expected a whole number, 0 (off) or more"),
                       (["--top-p", "0"], "--top-p 0.0: expected above 0, at most 1"),
                       (["--top-p", "1.5"], "--top-p 1.5: expected above 0, at most 1"),
                       (["--device", "xyz"], "--device xyz: not usable here"),
                       *[(["--device", "cuda"], "this torch sees no CUDA GPU")] * (not torch.cuda.is_available())):
        with pytest.raises(ValueError, match=re.escape(msg)):
            generate.main(generate.parser().parse_args(["-c", "no/such/checkpoint", *flags]))
    path = Path(shutil.copytree(hf_tiny[1], tmp_path / "ckpt"))
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"default top_p 0 .* override it with --top-p"):
        generate.load_model(generate.parser().parse_args(["-c", str(path), "--device", "cpu"]))
    _, sampling = generate.load_model(generate.parser().parse_args(["-c", str(path), "--device", "cpu", "--top-p",
                                                                    "0.9"]))
    assert sampling["top_p"] == 0.9
    import chat                                                         # its /set takes the same ranges
    for name, value, msg in (("top_p", "0", "above 0, at most 1"), ("top_k", "-1", "a whole number, 0 (off)"),
                             ("temperature", "-2", "0 (greedy) or more"), ("max_tokens", "0", "1 or more"),
                             ("top_k", "2.5", "an integer, got '2.5'")):
        with pytest.raises(ValueError, match=re.escape(f"/set {name}: expected") + ".*" + re.escape(msg)):
            chat.set_setting(None, name, value)
    r = subprocess.run([sys.executable, str(HERE / "bench.py"), "--batch", "0", "65"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "each batch must be 1 to 64" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(HERE / "bench.py")], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "bench.py needs a CUDA GPU" in r.stderr


def test_cli_help():
    """--help of generate.py, chat.py and bench.py: every flag says what it does, defaults appear where there are
    some (never "None" or "False"), and the description keeps its lines (bench.py's example commands)."""
    import bench
    import chat
    import generate
    parsers = {"generate.py": generate.parser(), "chat.py": chat.parser(), "bench.py": bench.parser()}
    for name, p in parsers.items():
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings}: no help"
    helps = {name: p.format_help() for name, p in parsers.items()}
    for text in helps.values():
        assert "(default: None)" not in text and "(default: False)" not in text, text
    assert "\nOnly the generated text goes to stdout" in helps["generate.py"]
    assert "(default: 200)" in helps["generate.py"]
    assert "\npython bench.py --weights bf16 --paths fast" in helps["bench.py"]
    assert "(default: [512, 32768])" in helps["bench.py"]


# -----------------------------------------------------------------------------
# Tokenizer and chat template, with HF tokenizers as the oracle

# Mixed text for training and parity: code, CRLF and tabs, digits and long numbers, contractions,
# Han inside and outside U+4E00-9FA5, kana, emoji with ZWJ and modifiers, control characters.
SAMPLES = [
    "def encode(self, text: str) -> list[int]:\n    return [self.vocab[t] for t in text.split()]\n",
    "for (int i = 0; i < 1024; ++i) {\r\n\tsum += x[i] * 31415926;\r\n}\r\n",
    "The model's outputs weren't what we'd expected. We'LL see; IT'S fine. HELLO World's GREAT",
    "Pi is 3.14159265358979 and e is 2.718281828; 1,234,567,890 users in 2025. a  1 b\t\t2",
    "你好，世界！今天天气很好。我们去公园散步吧。 你好world",
    "𠀀𠀁𠮷野家 㐀㐁 鿰鿱 漢字かな交じり文",
    "ひらがなとカタカナ、コンピューター。すごい！ｶﾀｶﾅ ゟヿ",
    "emoji 👨‍👩‍👧‍👦 👍🏽 🏳️‍🌈 ❤️ 🇯🇵 ok👍",
    "control \x01\x02\x1b[0m bell\x07 nul\x00 del\x7f \x1c\x1f",
    "spaces     and\t\ttabs \u00a0nbsp \u3000ideographic\n\n\n   \n  x",
    "Ünïcödé façade naïve résumé Ελληνικά русский текст العربية हिन्दी e\u0301",
    "<think>reasoning here</think> answer <|endoftext|> <tool_call>get_weather\n<arg_key>city</arg_key></tool_call>",
]
SPECIALS = ["<|endoftext|>", "<think>", "</think>"]
TRICKY = ["", " ", "a  1", " 你好world", "\x01\x02", "👨‍👩‍👧", "x" * 700, " " * 300 + "x", "\n" * 50, "1234567",
          "<think>hi</think>", "<|endoftext|><|endoftext|>", "a <tool_call>  b", "x\u3000<tool_call>\x1c y",
          "[MASK] a[MASK] [MASK]b _[MASK].", "<think", "<|endoftext|", "it's 'LL 'll 'S", "<tool <tool_call> <tool_c",
          "thin</think>", "<tool_call>  <tool_call>"]


def random_texts(n, seed=0):
    """Random splices of the samples and odd characters: pieces meet in every combination."""
    rng = random.Random(seed)
    chars = [*" \t\n\r\x01\u200d\u3000\u00a0'0123456789aZ你ゟ𠮷👍🏽é\u0301,.<>|", *SPECIALS, "<tool_call>", "[MASK]"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 6)):
            s = rng.choice(SAMPLES)
            i = rng.randrange(len(s))
            parts.append(s[i:i + rng.randint(0, 30)] if rng.random() < 0.7 else "".join(rng.choices(chars, k=5)))
        out.append("".join(parts))
    return out


def flint_pre_tokenizer():
    """The spec §5 pre-tokenizer, built with `tokenizers`."""
    splits = [pre_tokenizers.Split(Regex(p), "isolated") for p in FLINT_SPLITS]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A trained tokenizer.json (+ tokenizer_config, generation_config) in a temp dir."""
    d = tmp_path_factory.mktemp("tok")
    tok = tokenizers.Tokenizer(BPE())
    tok.pre_tokenizer = flint_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS,
                         show_progress=False)
    tok.train_from_iterator(SAMPLES * 20 + random_texts(400, seed=1), trainer)
    # non-special added tokens: lstrip/rstrip, single_word, a prefix of another, one overlapping "</think>" on
    # the left (special tokens are matched first, so "</think>" wins)
    tok.add_tokens([AddedToken("<tool_call>", lstrip=True, rstrip=True), AddedToken("[MASK]", single_word=True),
                    AddedToken("<tool"), AddedToken("n</")])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}, "bos_token": None}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id("</think>")]}))
    return d


def variant(src, dst, edit):
    """Copy tokenizer.json with edit(json) applied; return (our tokenizer, HF tokenizer)."""
    tj = json.loads((src / "tokenizer.json").read_text())
    edit(tj)
    dst.mkdir(exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return Tokenizer.from_files(dst / "tokenizer.json"), tokenizers.Tokenizer.from_file(str(dst / "tokenizer.json"))


def add_unrebuilt_token(tj, hf):
    """Add a vocab token X = a + b, merge (a, b), where HF's BPE of X's bytes never reaches [a, b]."""
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    words = [t for t in vocab if re.fullmatch("[a-z]{2,4}", t)]
    for a in words:
        for b in words:
            # BPE only shrinks the token list, so it never passes through [a, b] if it does not end there
            if a + b not in vocab and hf.encode(a + b, add_special_tokens=False).ids != [vocab[a], vocab[b]]:
                # tokenizers numbers added tokens after the model vocab, so shift those above it
                for t in tj["added_tokens"]:
                    t["id"] += t["id"] >= len(vocab)
                vocab[a + b] = len(vocab)
                merges.append([a, b])
                return a + b
    raise AssertionError("no token pair found that merges across its edge")


def test_pre_tokenizer_examples(hf_dir):
    """Spec §5 examples: isolated gaps and pieces that a single regex would drop."""
    tok = Tokenizer.from_files(hf_dir / "tokenizer.json")
    assert tok._pre_tokenize("a  1") == ["a", "  ", "1"]
    assert tok._pre_tokenize(" 你好world") == [" ", "你好", "world"]
    assert tok._pre_tokenize("\x01\x02") == ["\x01\x02"]
    assert "".join(tok._pre_tokenize(SAMPLES[7])) == SAMPLES[7]


@pytest.mark.parametrize("ignore_merges", [False, True])
@pytest.mark.parametrize("repeat_merge", [False, True])
def test_parity_with_tokenizers(hf_dir, tmp_path, ignore_merges, repeat_merge):
    """Byte-exact ids vs tokenizers with a token the merges never rebuild; repeat_merge takes the slow check."""
    added = []

    def edit(tj):
        tj["model"]["ignore_merges"] = ignore_merges
        added.append(add_unrebuilt_token(tj, tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))))
        vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
        for m in merges if repeat_merge else []:  # a second merge for an existing result, through another split
            x = "".join(m)
            splits = [[x[:i], x[i:]] for i in range(1, len(x)) if x[:i] != m[0] and x[:i] in vocab and x[i:] in vocab]
            if splits:
                merges.append(splits[0])
                break

    ours, hf = variant(hf_dir, tmp_path, edit)
    x = added[0]
    assert ours._unrebuilt == {hf.token_to_id(x)}
    assert (len(hf.encode(x, add_special_tokens=False).ids) == 1) == ignore_merges
    for text in SAMPLES + TRICKY + random_texts(300) + [x, x + x, " " + x + "s"]:
        expected = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, repr(text)
        assert ours.decode(expected) == hf.decode(expected, skip_special_tokens=False), repr(text)
    hf.encode_special_tokens = True  # HF's switch for reading special-token text as plain text
    for text in TRICKY + SAMPLES:
        assert ours.encode(text, allow_special=False) == hf.encode(text, add_special_tokens=False).ids, repr(text)


def test_merge_check_matches_bpe():
    """The fast in-order merge check agrees with running HF's BPE, on random merge lists (many unrebuilt)."""
    rng = random.Random(0)
    for _ in range(500):
        letters = "abcd"[:rng.randint(1, 4)]
        tokens, merges = list(letters), []
        for _ in range(200 if len(letters) > 1 else 7):  # random merges, each after its parts: training order
            a, b = rng.choice(tokens), rng.choice(tokens)
            if a + b not in tokens and len(a + b) <= 8:
                tokens.append(a + b)
                merges.append((tokens.index(a), tokens.index(b), len(tokens) - 1))
            if len(merges) == 30:
                break
        pairs = {(a, b): (k, x) for k, (a, b, x) in enumerate(merges)}
        slow = {}
        for _, _, x in merges:
            out, rank = _hf_bpe([tokens.index(c) for c in tokens[x]], pairs)
            slow.update({x: rank} if out == [x] else {})
        assert _rebuilt_in_order(merges, list(range(len(letters))), pairs) == slow, [tokens[x] for _, _, x in merges]


def test_nfc_string_split_prefix_space_variants(hf_dir, tmp_path):
    """NFC, a String Split and ByteLevel(add_prefix_space, use_regex) follow tokenizers too."""

    def edit(tj):
        tj["normalizer"] = {"type": "NFC"}
        tj["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Split", "pattern": {"String": "."},
                                                        "behavior": "Isolated", "invert": True})
        tj["pre_tokenizer"]["pretokenizers"][-1].update(add_prefix_space=True, use_regex=True)

    ours, hf = variant(hf_dir, tmp_path, edit)
    for text in SAMPLES + TRICKY + random_texts(100, seed=2):
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, repr(text)


def test_decode_roundtrip_and_invalid_utf8(hf_dir):
    """decode(encode(x)) == x; ids that cut a character apart decode to U+FFFD like tokenizers."""
    tok = Tokenizer.from_files(hf_dir / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in [t for t in SAMPLES + TRICKY if "<tool_call>" not in t]:  # lstrip/rstrip eat spaces
        assert tok.decode(tok.encode(text)) == text
    rng = random.Random(0)
    byte_ids = [hf.token_to_id(BYTE_TO_CHAR[b]) for b in range(256)]
    for _ in range(300):
        ids = rng.choices(byte_ids, k=rng.randint(1, 8))
        assert tok.decode(ids) == hf.decode(ids), ids
    assert tok.token_bytes(tok.token_to_id("<think>")) == b"<think>"
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.decode([tok.n_vocab])


def test_stream_decoder_never_splits_a_character():
    """Multi-byte characters pushed byte by byte come out whole, and the stream equals decode()."""
    tok = Tokenizer.byte_level(TINY_SPECIAL_TOKENS, eos_token="<|end|>")
    text = "<|user|>héllo 你好 👨‍👩‍👧 ok<|end|>"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # bytes, not characters
    stream = StreamDecoder(tok)
    parts = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(parts) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)
    bad = ids[:-3] + [0xE4]  # a character cut short at the end
    stream = StreamDecoder(tok)
    assert "".join([stream.push(i) for i in bad] + [stream.flush()]) == tok.decode(bad)


def test_byte_level_tokenizer():
    """Ids 0..255 are the bytes, specials follow, and special text is plain text on request."""
    tok = Tokenizer.byte_level(TINY_SPECIAL_TOKENS, eos_token="<|end|>")
    assert tok.n_vocab == 256 + len(TINY_SPECIAL_TOKENS)
    assert tok.encode("A<|end|>") == [65, tok.token_to_id("<|end|>")]
    assert tok.encode("A<|end|>", allow_special=False) == list(b"A<|end|>")
    assert tok.eos_ids == {260} and tok.bos_id is None


def test_special_ids_from_files(hf_dir, tmp_path):
    """eos = generation_config ∪ tokenizer_config ∪ config.json; bos/pad by string or id; token_to_id."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 7}))
    tok = Tokenizer.from_files(hf_dir / "tokenizer.json", hf_dir / "tokenizer_config.json",
                               hf_dir / "generation_config.json", tmp_path / "config.json")
    eot, think_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("</think>")
    assert tok.eos_ids == {eot, think_end, 5}
    assert tok.bos_id == 7 and tok.pad_id is None
    assert tok.special_tokens == {"eos_token": "<|endoftext|>", "bos_token": tok.decode([7])}
    assert tok.token_to_id("<think>") is not None and tok.token_to_id("<nope>") is None
    assert tok.token_to_id("a") == tok.encode("a")[0]
    plain = Tokenizer.from_files(hf_dir / "tokenizer.json", tmp_path / "absent.json")
    assert plain.eos_ids == set() and plain.bos_id is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=re.escape("'<|im_end|>' is no token")):
        Tokenizer.from_files(hf_dir / "tokenizer.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(ValueError, match="not one of the tokenizer"):
        Tokenizer.from_files(hf_dir / "tokenizer.json", None, tmp_path / "generation_config.json")


def gguf_tokenizer_fields(tokenizer_json):
    """tokenizer.ggml.{tokens, token_type, merges} for a tokenizer.json, as HF -> GGUF converters write them."""
    tj = json.loads(Path(tokenizer_json).read_text())
    n = 1 + max(max(tj["model"]["vocab"].values()), max(a["id"] for a in tj["added_tokens"]))
    tokens, types = [f"[PAD{i}]" for i in range(n)], [5] * n
    for s, i in tj["model"]["vocab"].items():
        tokens[i], types[i] = s, 1
    for a in tj["added_tokens"]:
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a["special"] else 4
    return tokens, types, [" ".join(m) for m in tj["model"]["merges"]]


def test_gguf_fields_match_tokenizer_json(hf_dir):
    """tokenizer.ggml.* fields built from the same vocab/merges give the same ids."""
    tokens, types, merges = gguf_tokenizer_fields(hf_dir / "tokenizer.json")
    ours = Tokenizer.from_files(hf_dir / "tokenizer.json")
    eot = ours.token_to_id("<|endoftext|>")
    gguf = Tokenizer.from_gguf_fields(tokens, types, merges, bos_id=None, eos_ids=[eot], pre="flint")
    assert gguf.eos_ids == {eot} and gguf.n_vocab == ours.n_vocab
    # GGUF has no lstrip/rstrip/single_word, so leave out texts where those flags act
    for text in [t for t in SAMPLES + TRICKY + random_texts(200) if "<tool_call>" not in t and "[MASK]" not in t]:
        assert gguf.encode(text) == ours.encode(text), repr(text)
    with pytest.raises(ValueError, match="llama-bpe"):
        Tokenizer.from_gguf_fields(tokens, types, merges, None, [eot], pre="llama-bpe")


@pytest.mark.parametrize("edit, match", [
    (lambda tj: tj["model"].update(type="WordPiece"), "WordPiece"),
    (lambda tj: tj["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"), "Removed"),
    (lambda tj: tj["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Digits"}), "Digits"),
    (lambda tj: tj["pre_tokenizer"]["pretokenizers"].pop(), "no ByteLevel"),
    (lambda tj: tj.update(normalizer={"type": "Lowercase"}), "Lowercase"),
    (lambda tj: tj["model"]["merges"].append(["zzzq", "qq"]), "not in the vocab"),
    (lambda tj: tj["model"]["merges"].append("a b c"), "neither"),
])
def test_bad_tokenizer_json(hf_dir, tmp_path, edit, match):
    """Each unsupported or corrupt tokenizer.json gives a ValueError that names the problem."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    edit(tj)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match=re.escape(match)):
        Tokenizer.from_files(tmp_path / "tokenizer.json")


def test_missing_and_malformed_files(tmp_path):
    """A missing tokenizer.json is FileNotFoundError, broken JSON a ValueError naming the file."""
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_files(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="malformed JSON"):
        Tokenizer.from_files(tmp_path / "tokenizer.json")


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <3 «ü»"},
        {"role": "assistant", "content": "Hello."}]
TEMPLATE = """{{ bos_token }}{% for m in messages %}
{% if m.role == 'tool' %}{{ raise_exception('no tools here: ' ~ m.content) }}{% endif %}
[{{ m.role }}] {{ m.content }}{{ eos_token }}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}"""


def test_render_chat(hf_dir):
    """trim_blocks/lstrip_blocks, special-token strings, tojson without escaping, raise_exception."""
    tok = Tokenizer.from_files(hf_dir / "tokenizer.json", hf_dir / "tokenizer_config.json")
    tok.special_tokens["bos_token"] = "<s>"
    out = render_chat(TEMPLATE, CHAT, tokenizer=tok, tools=[{"name": "f", "d": "<ü>"}])
    assert out == ("<s>[system] Be brief.<|endoftext|>\n[user] Hi <3 «ü»<|endoftext|>\n"
                   "[assistant] Hello.<|endoftext|>\n" '[{"name": "f", "d": "<ü>"}][assistant]')
    assert render_chat(TEMPLATE, CHAT[:1], add_generation_prompt=False).endswith("Be brief.\n")
    with pytest.raises(ChatTemplateError, match="no tools here: x"):
        render_chat(TEMPLATE, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% for m in messages %}", CHAT)
    assert render_chat("{{ strftime_now('%Y') | length }}", []) == "4"
    tiny = render_chat(TINY_CHAT_TEMPLATE, CHAT[1:2])
    assert tiny == "<|user|>Hi <3 «ü»<|end|><|assistant|>"
    assert Tokenizer.byte_level(TINY_SPECIAL_TOKENS).encode(tiny)[0] == 256 + TINY_SPECIAL_TOKENS.index("<|user|>")


def test_find_chat_template(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json, whose list form gives 'default'."""
    assert find_chat_template(tmp_path) is None
    cfg = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    cfg.write_text(json.dumps({"chat_template": named}))
    assert find_chat_template(tmp_path) == "D"
    cfg.write_text(json.dumps({"chat_template": "S"}))
    assert find_chat_template(tmp_path) == "S"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert find_chat_template(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").unlink()
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ValueError, match="no 'default'"):
        find_chat_template(tmp_path)


# -----------------------------------------------------------------------------
# NVFP4 checkpoints: the official GGUF layout and ModelOpt exports, quantized here from a tiny transformers model

GGML = gguf.GGMLQuantizationType
E2M1_VALUES = torch.tensor(flint.E2M1)
NVFP4_TINY = dict(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64)  # K % 64 == 0
NO_SCALE = "model.layers.0.self_attn.k_proj.weight"     # global scale 1.0, its GGUF .scale tensor left out
ZERO_BLOCK = "model.layers.4.self_attn.o_proj.weight"   # one all-zero block: scale byte 0x00, written 0x7F in GGUF
SIGN_BIT = "model.layers.1.mlp.down_proj.weight"        # GGUF scale bytes with bit 7 set, which ggml ignores


def test_nvfp4_repack_matches_gguf_dequantize():
    """Repacked ggml blocks dequantize bit for bit like gguf.quants: every nibble, subnormal scales, 0x00, 0x7F
    (zero in ggml, NaN in e4m3fn) and bytes with bit 7 set; 0xFF is refused."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (48, 8 * 36), dtype=torch.uint8, generator=g)   # 48 rows of K = 512
    d = blocks.unflatten(-1, (-1, 36))[..., :4]                                     # the scale bytes (a view)
    d.copy_(torch.randint(0, 0xFF, d.shape, dtype=torch.uint8, generator=g))       # any byte but 0xFF
    d[0, :3] = torch.tensor([[0x00, 0x7F, 0x01, 0x04], [0x07, 0x08, 0x80, 0x81], [0xFE, 0x7E, 0x78, 0xF8]])
    assert set(blocks.unflatten(-1, (-1, 36))[..., 4:].flatten().tolist()) == set(range(256))  # every nibble pair
    packed, scales = load.repack_nvfp4(blocks)
    ours = flint.NVFP4(packed, scales, torch.ones(48)).dequantize()
    want = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), GGML.NVFP4))
    assert not ours.isnan().any()
    # ggml's code 8 is +0, flint's E2M1 table says -0: adding +0.0 equates the two zeros, nothing else
    assert torch.equal((ours + 0.0).view(torch.int32), (want + 0.0).view(torch.int32))
    blocks[3, 36 * 5 + 2] = 0xFF
    with pytest.raises(ValueError, match="0xFF"):
        load.repack_nvfp4(blocks, "blk.0.attn_q.weight")


def quantize_nvfp4(w, g):
    """w [..., N, K] with global scale g -> codes uint8 [..., N, K], E4M3 block scales [..., N, K/16] and the
    weight they decode to, e2m1 * e4m3 * g (fp32, in flint's order): per 16 values a scale amax/6, nearest code."""
    blocks = w.unflatten(-1, (-1, 16))
    s = (blocks.abs().amax(-1) / 6 / g).clamp(max=448).to(torch.float8_e4m3fn)
    unit = (s.float() * g)[..., None]
    codes = (blocks / unit.clamp_min(1e-30))[..., None].sub(E2M1_VALUES).abs().argmin(-1)   # ties: +0 before -0
    deq = (E2M1_VALUES[codes] * s.float()[..., None]).flatten(-2) * g
    return codes.flatten(-2).to(torch.uint8), s, deq


def ggml_blocks(codes, scales):
    """codes [..., K], scales [..., K/16] -> ggml NVFP4 blocks uint8 [..., K/64*36] (spec §4c)."""
    c = codes.unflatten(-1, (-1, 4, 16))                                # [..., K/64, 4, 16]
    qs = c[..., :8] | (c[..., 8:] << 4)                                 # byte i: element i low, i + 8 high
    return torch.cat([scales.view(torch.uint8).unflatten(-1, (-1, 4)), qs.flatten(-2)], -1).flatten(-2)


@pytest.fixture(scope="module")
def nvfp4_tiny(tmp_path_factory):
    """A transformers-saved tiny Flint quantized to NVFP4 in the test: each linear weight (each expert's own) gets a
    global scale, mostly not 1.0. Holds the saved tensors, the quantization, the weights it decodes to, and the
    logits of the two oracles on those weights: flint.py's reference and transformers."""
    hf = hf_model(**NVFP4_TINY)
    with torch.no_grad():                                               # the GGUF stores the embedding as BF16
        hf.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight.bfloat16())
    src = save_hf(hf, tmp_path_factory.mktemp("nvfp4_src"), shard="10MB")
    from safetensors.torch import load_file
    state = load_file(src / "model.safetensors")
    state[ZERO_BLOCK][0, :16] = 0
    quant, deq = {}, dict(state)
    for name, w in state.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            g = torch.tensor(1.0) if name == NO_SCALE else w.abs().amax() / (6 * 448) * 0.7
            codes, scales, deq[name] = quantize_nvfp4(w, g)
            quant[name] = (codes, scales, g)
    ids = torch.randint(0, 320, (2, 3 * hf.config.sliding_window + 4), generator=torch.Generator().manual_seed(1))
    return SimpleNamespace(src=src, state=state, quant=quant, deq=deq, ids=ids,
                           want=oracle_logits(src, deq, ids, tmp_path_factory.mktemp("nvfp4_deq")))


def oracle_logits(src, weights, ids, path):
    """(flint reference, transformers) logits of the model with these weights (by HF name), fp32."""
    from safetensors.torch import save_file
    from transformers import FlintForCausalLM
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((src / f).read_bytes())
    hf = FlintForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        return flint_from(path)(ids, pos), hf(ids).logits


def gguf_name(hf):
    """The official GGUF name of a transformers-saved tensor (spec §4c), and its expert index (None if not one)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf], None
    L, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf).groups()
    expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)_proj\.weight", rest)
    if expert:
        return f"blk.{L}.ffn_{expert[2]}_exps.weight", int(expert[1])
    rest = re.sub(r"^mlp\.shared_expert\.(\w+)_proj", r"ffn_\1_shexp", rest)
    rest = re.sub(r"^mlp\.(\w+)_proj", r"ffn_\1", rest)
    rest = re.sub(r"^self_attn\.o_proj", "attn_output", rest)
    rest = re.sub(r"^self_attn\.(\w)_proj", r"attn_\1", rest)
    rest = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
            "self_attn.softmax_offset": "attn_sinks.weight", "mlp.gate.weight": "ffn_gate_inp.weight"}.get(rest, rest)
    return f"blk.{L}.{rest}", None


def gguf_contents(nq, types=None):
    """GGUF metadata {key: (writer kind, value)} and tensors {name: (array, ggml type)} of the tiny model in the
    official naming and types (NVFP4 linears with .scale, BF16 embedding, F32 rest). A GGUF name in `types` is
    written in that type from the decoded weight instead; returns the weights the file decodes to, by HF name."""
    types = types or {}
    cfg = json.loads((nq.src / "config.json").read_text())
    sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
    tokens, token_types, merges = gguf_tokenizer_fields(nq.src / "tokenizer.json")
    meta = {"general.file_type": ("uint32", 39)} | {f"flint.{k}": v for k, v in {
        "block_count": ("uint32", cfg["num_hidden_layers"]), "context_length": ("uint32", 512),
        "embedding_length": ("uint32", cfg["hidden_size"]), "feed_forward_length": ("uint32", cfg["intermediate_size"]),
        "attention.head_count": ("uint32", cfg["num_attention_heads"]),
        "attention.head_count_kv": ("uint32", cfg["num_key_value_heads"]),
        "attention.key_length": ("uint32", cfg["head_dim"]), "attention.value_length": ("uint32", cfg["head_dim"]),
        "attention.layer_norm_rms_epsilon": ("float32", cfg["rms_norm_eps"]),
        "rope.freq_base": ("float32", cfg["rope_parameters"]["rope_theta"]),
        "attention.sliding_window": ("uint32", cfg["sliding_window"]),
        "attention.sliding_window_pattern": ("array", sliding), "attention.rope_pattern": ("array", sliding),
        "leading_dense_block_count": ("uint32", len(cfg["mlp_only_layers"])),
        "expert_count": ("uint32", cfg["num_experts"]), "expert_used_count": ("uint32", cfg["num_experts_per_tok"]),
        "expert_feed_forward_length": ("uint32", cfg["moe_intermediate_size"]),
        "expert_shared_feed_forward_length": ("uint32", cfg["shared_expert_intermediate_size"]),
        "expert_weights_norm": ("bool", cfg["norm_topk_prob"]), "expert_weights_scale": ("float32", 1.0),
        "expert_gating_func": ("uint32", 2)}.items()} | {
        "tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "flint"),
        "tokenizer.ggml.tokens": ("array", tokens), "tokenizer.ggml.token_type": ("array", token_types),
        "tokenizer.ggml.merges": ("array", merges),
        "tokenizer.ggml.eos_token_id": ("uint32", tokens.index("<|endoftext|>")),
        "tokenizer.chat_template": ("string", TEMPLATE)}
    groups = {}                                                         # GGUF name -> {expert or None: HF name}
    for hf in nq.state:
        name, e = gguf_name(hf)
        groups.setdefault(name, {})[e] = hf
    tensors, decoded = {}, {}
    for name, hfs in groups.items():
        hfs = [hfs[e] for e in sorted(hfs, key=lambda e: -1 if e is None else e)]
        stack = torch.stack if len(hfs) > 1 else (lambda ts: ts[0])
        kind = types.get(name, GGML.NVFP4 if hfs[0] in nq.quant else GGML.BF16 if "embd" in name else GGML.F32)
        if kind == GGML.NVFP4:
            codes, scales, g = (stack([nq.quant[h][i] for h in hfs]) for i in range(3))
            blocks = ggml_blocks(codes, scales)
            d = blocks.unflatten(-1, (-1, 36))[..., :4]
            if ZERO_BLOCK in hfs:
                d.masked_fill_(d == 0, 0x7F)
            if SIGN_BIT in hfs:
                d |= 0x80
            tensors[name] = (blocks.numpy(), GGML.NVFP4)
            if NO_SCALE not in hfs:
                tensors[name.replace(".weight", ".scale")] = (g.reshape(-1).float().numpy(), None)
            continue
        w = stack([nq.deq[h] for h in hfs])
        if kind == GGML.F32:
            tensors[name] = (w.numpy(), None)
            continue
        if kind == GGML.BF16:
            data, back = w.bfloat16().view(torch.int16).numpy().view(np.uint16), w.bfloat16().float()
        elif kind == GGML.F16:
            data, back = w.half().numpy(), w.half().float()
        elif kind == GGML.I32:                                          # a type gguf cannot dequantize
            data, back = w.int().numpy(), w
        else:
            data = gguf.quants.quantize(w.numpy(), kind)
            back = torch.from_numpy(gguf.quants.dequantize(data, kind))
        tensors[name] = (data, None if kind in (GGML.F16, GGML.I32) else kind)
        decoded |= {h: b.clone() for h, b in zip(hfs, back if len(hfs) > 1 else [back])}
    return meta, tensors, decoded


def write_gguf(path, meta, tensors):
    w = gguf.GGUFWriter(str(path), "flint")
    for key, (kind, value) in meta.items():
        getattr(w, f"add_{kind}")(key, value)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_modelopt(path, nq, quantization=None):
    """The ModelOpt NVFP4 export of the tiny model: uint8 weight (low nibble first), E4M3 weight_scale, fp32
    weight_scale_2 (both [] and [1] shapes), an input_scale and a k_scale that flint ignores, BF16 embedding."""
    from safetensors.torch import save_file
    quantization = quantization or {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    tensors = {}
    for i, (name, w) in enumerate(nq.state.items()):
        if name not in nq.quant:
            tensors[name] = w.bfloat16() if "embed" in name else w
            continue
        codes, scales, g = nq.quant[name]
        base = name.removesuffix("weight")
        tensors |= {name: codes[..., 0::2] | (codes[..., 1::2] << 4), base + "weight_scale": scales,
                    base + "weight_scale_2": g.float().reshape([1] * (i % 2)), base + "input_scale": torch.tensor(1.0)}
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((nq.src / "config.json").read_text()) | {"quantization_config": quantization}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((nq.src / f).read_bytes())
    return path


def assert_logits_match(model, ids, want):
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    got = model(ids, pos)
    for w in want:                                                      # flint reference, then transformers
        assert (got - w).abs().max() <= 1e-4


@pytest.mark.parametrize("fmt", ["gguf", "modelopt"])
def test_nvfp4_checkpoint_matches_oracles(nvfp4_tiny, tmp_path, fmt):
    """The official GGUF layout and the ModelOpt export load 4-bit, decode to exactly the quantized weights, and
    give the logits of flint's reference and of transformers on those weights (fp32, 1e-4)."""
    nq = nvfp4_tiny
    if fmt == "gguf":
        path = write_gguf(tmp_path / "flint-nvfp4.gguf", *gguf_contents(nq)[:2])
    else:
        path = write_modelopt(tmp_path / "flint-nvfp4", nq)
    ckpt = load.load(str(path), "cpu", torch.float32, progress=False)
    model = ckpt.model
    for name, w in model.weights():
        assert isinstance(w, flint.NVFP4) == name.endswith(load.NVFP4_WEIGHTS), name
    head = model.lm_head
    assert torch.equal(head.dequantize() * head.row_scale[:, None], nq.deq["lm_head.weight"])
    scales = [nq.quant[f"model.layers.3.mlp.experts.{e}.down_proj.weight"][2] for e in range(8)]
    assert torch.equal(model.layers[3].ffn.down.row_scale[:, 0], torch.stack(scales))  # one per expert
    assert_logits_match(model, nq.ids, nq.want)
    if fmt == "gguf":
        tok = ckpt.tokenizer
        assert ckpt.chat_template == TEMPLATE and tok.eos_ids == {tok.token_to_id("<|endoftext|>")}


def test_gguf_tokenizer_matches_tokenizers(nvfp4_tiny, tmp_path):
    """The tokenizer rebuilt from tokenizer.ggml.* encodes like the tokenizers library on the tokenizer.json."""
    path = write_gguf(tmp_path / "flint.gguf", *gguf_contents(nvfp4_tiny)[:2])
    ours = load.load(str(path), "cpu", torch.float32, progress=False).tokenizer
    hf = tokenizers.Tokenizer.from_file(str(nvfp4_tiny.src / "tokenizer.json"))
    for text in SAMPLES + TRICKY + random_texts(100, seed=3):
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, repr(text)


def test_gguf_other_types_are_dequantized(nvfp4_tiny, tmp_path, capfd):
    """Community GGUF types load dequantized, with one notice: Q8_0 inside a fused q/k/v (whose NVFP4 parts are
    dequantized too), F16, BF16 and a stacked Q8_0 expert tensor; logits follow the weights the file decodes to."""
    types = {"blk.2.attn_k.weight": GGML.Q8_0, "blk.0.ffn_down.weight": GGML.F16, "output.weight": GGML.BF16,
             "blk.3.ffn_up_exps.weight": GGML.Q8_0}
    meta, tensors, decoded = gguf_contents(nvfp4_tiny, types)
    model = flint_from(write_gguf(tmp_path / "mixed.gguf", meta, tensors))
    err = capfd.readouterr().err
    assert "2 tensors of type Q8_0 (2) are dequantized" in err and "layers.2.attn.qkv" in err
    nvfp4 = {n for n, w in model.weights() if isinstance(w, flint.NVFP4)}
    assert not {"layers.2.attn.qkv", "layers.0.ffn.down", "lm_head", "layers.3.ffn.gate_up"} & nvfp4
    assert {"layers.3.attn.qkv", "layers.3.ffn.down"} <= nvfp4
    weights = nvfp4_tiny.deq | decoded
    assert_logits_match(model, nvfp4_tiny.ids, oracle_logits(nvfp4_tiny.src, weights, nvfp4_tiny.ids, tmp_path))


def _edit(meta=None, drop=(), add=None, blocks=None):
    """A GGUF variant: metadata updates (value None deletes), tensors dropped, added, or edited in place."""
    def apply(m, t):
        for k, v in (meta or {}).items():
            m.pop(k) if v is None else m.update({k: v})
        for name in drop:
            t.pop(name)
        t.update(add or {})
        if blocks:
            blocks(t)
    return apply


def _bad_scale_byte(t):
    data = t["blk.2.attn_q.weight"][0].copy()
    data[1, 2] = 0xFF                                                   # row 1: the scale of sub-block 2
    t["blk.2.attn_q.weight"] = (data, GGML.NVFP4)


@pytest.mark.parametrize("edit, match", [
    (_edit(meta={"general.tensor_extra.prec_a4": ("array", [False, True])}), "prec_a4"),
    (_edit(blocks=_bad_scale_byte), r"blk.2.attn_q.weight: 1 NVFP4 block scales are the invalid byte 0xFF"),
    (_edit(drop=["blk.3.ffn_up_exps.weight"]), r"ffn_up_exps.weight \(for flint layers.3.ffn.gate_up\) is missing"),
    (_edit(meta={"flint.expert_feed_forward_length": ("uint32", 32)}), r"ffn_gate_exps.weight has shape \[8, 64, 64\]"),
    (_edit(meta={"flint.expert_count": None}), r"\['flint.expert_count'\] are missing"),
    (_edit(meta={"general.architecture": ("string", "llama")}), "architecture is 'llama'"),
    (_edit(meta={"flint.expert_gating_func": ("uint32", 1)}), r"1 \(softmax\), but Flint routes with sigmoid"),
    (_edit(meta={"flint.expert_weights_scale": ("float32", 2.5)}), "expert_weights_scale is 2.5"),
    (_edit(add={"blk.2.exp_probs_b.bias": (np.zeros(8, np.float32), None)}), "unexpected tensors.*exp_probs_b"),
    (_edit(add={"blk.3.ffn_down_exps.scale": (np.ones(3, np.float32), None)}), "expected 8 finite global scale"),
    (_edit(meta={"tokenizer.ggml.merges": None}), r"tokenizer.ggml.merges'\] are missing"),
], ids=["prec_a4", "scale-0xFF", "missing-tensor", "shape-vs-metadata", "missing-key", "architecture", "gating",
        "weights-scale", "unknown-tensor", "scale-count", "no-merges"])
def test_gguf_rejects(nvfp4_tiny, tmp_path, edit, match):
    meta, tensors, _ = gguf_contents(nvfp4_tiny)
    edit(meta, tensors)
    with pytest.raises(ValueError, match=match):
        load.load(str(write_gguf(tmp_path / "bad.gguf", meta, tensors)), progress=False)


def test_gguf_rejects_truncated_and_undequantizable(nvfp4_tiny, tmp_path):
    meta, tensors, _ = gguf_contents(nvfp4_tiny, {"blk.2.ffn_gate_inp.weight": GGML.I32})
    with pytest.raises(ValueError, match="blk.2.ffn_gate_inp.weight has ggml type I32, which the gguf package cannot"):
        load.load(str(write_gguf(tmp_path / "i32.gguf", meta, tensors)), progress=False)
    path = write_gguf(tmp_path / "cut.gguf", *gguf_contents(nvfp4_tiny)[:2])
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        load.load(str(path), progress=False)
    os.truncate(path, 1000)                                             # inside the metadata
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        load.load(str(path), progress=False)


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {"g": {"weights": {"group_size": 8}}}},
     "group_size 8"),
])
def test_modelopt_rejects_other_quantizations(nvfp4_tiny, tmp_path, quantization, match):
    with pytest.raises(ValueError, match=match):
        load.load(str(write_modelopt(tmp_path / "mo", nvfp4_tiny, quantization)), progress=False)


def test_modelopt_rejects_nan_scales(nvfp4_tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    path = write_modelopt(tmp_path / "mo", nvfp4_tiny)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
    tensors[name].view(torch.uint8)[0, 0] = 0x7F
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name} holds 1 NaN scale bytes"):
        load.load(str(path), progress=False)


def test_gguf_cross_checks_config_json(nvfp4_tiny, tmp_path):
    """A config.json beside the GGUF file must describe the same model."""
    path = write_gguf(tmp_path / "flint.gguf", *gguf_contents(nvfp4_tiny)[:2])
    cfg = json.loads((nvfp4_tiny.src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load.load(str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"sliding_window": 7}))
    with pytest.raises(ValueError, match="sliding_window is 5 in the GGUF metadata but 7 in"):
        load.load(str(path), progress=False)


def test_generate_reads_gguf(nvfp4_tiny, tmp_path):
    """generate.py takes a directory holding a .gguf as --checkpoint (the other tests load .gguf files)."""
    write_gguf(tmp_path / "flint.gguf", *gguf_contents(nvfp4_tiny)[:2])
    r = run_generate("-c", str(tmp_path), "-p", "def fib(n):", "-n", "4", "-t", "0", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4 and "in NVFP4" in r.stderr


def test_find_gguf(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    assert load.find_gguf(tmp_path) == load.find_gguf(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        load.find_gguf(tmp_path)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load.load(str(tmp_path / "a.gguf"), progress=False)


# -----------------------------------------------------------------------------
# Triton kernels (on the GPU, or in Triton's interpreter on a CPU) against their references

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


@kernels.triton.jit
def _e2m1_decode_kernel(byte_ptr, out_ptr):
    offs = kernels.tl.arange(0, 256)
    byte = kernels.tl.load(byte_ptr + offs)
    lo, hi = kernels._e2m1_pair(byte)
    kernels.tl.store(out_ptr + offs, lo)
    kernels.tl.store(out_ptr + 256 + offs, hi)


def test_e2m1_pair_decodes_every_byte():
    """NVFP4 decoding, all 256 bytes: low and high code as E2M1 values x 2^-14 (on the GPU the inline-PTX decoder;
    the interpreter runs the byte-by-byte one)."""
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    byte = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(512, device=DEV)
    _e2m1_decode_kernel[(1,)](byte.to(DEV), out)
    want = torch.cat([e2m1[byte.long() & 15], e2m1[byte.long() >> 4]]) * 2.0 ** -14
    assert torch.equal(out.cpu(), want) and torch.equal(out.cpu().signbit(), want.signbit())


@pytest.mark.parametrize("B", [1, 3, 6, 8])                 # 6, 8: bf16 on tensor cores, NVFP4 not
@pytest.mark.parametrize("nvfp4", [False, True])
def test_add_norm_linear_kernel(B, nvfp4, monkeypatch):
    K, N = 64, 40
    x, dx, nw = rand_act(B, K, seed=1), rand_act(B, K, seed=2), rand_act(K, seed=3)
    w = rand_weight(N, K, nvfp4=nvfp4)
    for wide_n in (kernels.WIDE_N, N):     # N: as wide as the lm_head, so normalized apart at batch 1 too
        monkeypatch.setattr(kernels, "WIDE_N", wide_n)
        for args in [(x, dx, nw, w, 1e-6), (x, None, nw, w, 1e-6)]:
            for f32 in (False, True):
                got, want = kernels.add_norm_linear(*args, f32=f32), flint.add_norm_linear_ref(*args, f32=f32)
                for g, r in zip(got, want):
                    close(g, r)
    monkeypatch.undo()
    close(kernels.linear(x, w), flint.linear_ref(x, w))
    w48 = rand_weight(48, K, nvfp4=nvfp4, seed=5)          # whole tiles (at B = 1: the unmasked EVEN path)
    for g, r in zip(kernels.add_norm_linear(x, dx, nw, w48, 1e-6), flint.add_norm_linear_ref(x, dx, nw, w48, 1e-6)):
        close(g, r)
    x96, dx96, nw96 = rand_act(B, 96, seed=6), rand_act(B, 96, seed=7), rand_act(96, seed=8)
    w96 = rand_weight(N, 96, nvfp4=nvfp4, seed=9)               # two steps along K, the second one half masked
    for g, r in zip(kernels.add_norm_linear(x96, dx96, nw96, w96, 1e-6),
                    flint.add_norm_linear_ref(x96, dx96, nw96, w96, 1e-6)):
        close(g, r)
    swiglu_w = rand_weight(2 * N, K, nvfp4=nvfp4, seed=4)
    for g, r in zip(kernels.add_norm_swiglu(x, dx, nw, swiglu_w, 1e-6),
                    flint.add_norm_swiglu_ref(x, dx, nw, swiglu_w, 1e-6)):
        close(g, r)


@pytest.mark.parametrize("window, S, H, G", [(5, 5, 4, 2), (0, 40, 8, 2), (7, 7, 8, 8), (40, 40, 8, 2)])
def test_attention_decode_kernel(window, S, H, G, monkeypatch):
    """Positions before, at and past the ring's wrap, two rows at different positions, GQA groups 1..4; a ring of
    40 slots takes two key steps per split (the interpreter's 2 splits of 16-key steps). The attention output
    alone, and through o_proj (bf16 and NVFP4, 48 rows: three blocks of the interpreter's 16) must be close to
    the reference's. The combine launch takes whole heads and blocks of their dims."""
    B, D, C = 2, 32, 48
    cfg = flint.Config(rope_theta=10000.0, head_dim=D)
    cos, sin = flint.rope_table(cfg, max(64, 2 * S + 8), DEV)
    q_norm, k_norm = rand_act(D, seed=5).float().abs().to(torch.bfloat16), rand_act(D, seed=6)
    sinks = torch.randn(H, device=DEV)
    tiles = kernels.ATTENTION_INTERPRETER if kernels.INTERPRET else kernels.ATTENTION
    for step, pos in enumerate([[0, 3], [4, 5], [6, 12], [S - 1, 2 * S + 3]]):
        pos = torch.tensor(pos, device=DEV) if window else torch.tensor(pos, device=DEV).clamp(max=S - 1)
        qkv = rand_act(B, (H + 2 * G) * D, seed=10 + step)
        kc, vc = rand_act(B, S, G, D, seed=20 + step), rand_act(B, S, G, D, seed=30 + step)
        w_o = [None, rand_weight(C, H * D, seed=step), rand_weight(C, H * D, nvfp4=True, seed=step), None][step]
        for combine_d in (8, D):
            for kind in ("sliding", "full"):
                monkeypatch.setitem(tiles[kind], "combine_d", combine_d)
            k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            got = kernels.attention_decode(qkv, q_norm, k_norm, sinks, cos, sin, k1, v1, pos, window, 1e-6, w_o)
            want = flint.attention_decode_ref(qkv, q_norm, k_norm, sinks, cos, sin, k2, v2, pos, window, 1e-6, w_o)
            assert got.dtype == torch.bfloat16
            close(got, want)
            close(k1, k2)
            assert torch.equal(v1, v2)


def check_sink_attention(window, H, G, T, start, seed=0):
    """The kernel against sink_attention_ref for chunks of T queries starting at positions start [B], over
    KVCache.store's layouts: a ring, oldest first, plus the chunk (sliding), or the first slots of a full cache
    where rows that have written less hold empty (negative) slots past their last position."""
    B, D = len(start), 32
    g = torch.Generator().manual_seed(seed)
    start = torch.tensor(start)
    q_pos = start[:, None] + torch.arange(T)
    if window:
        k_pos = torch.cat([start[:, None] - window + torch.arange(window), q_pos], 1)
    else:
        n = int(q_pos.max()) + 1
        k_pos = flint.slot_positions(q_pos[:, -1:], n)                  # slot = position, negative past the last
    k = rand_act(B, k_pos.shape[1], G, D, seed=seed + 2)
    v = rand_act(B, k_pos.shape[1], G, D, seed=seed + 3)
    if not window:                                                      # a strided slice of a longer cache
        k = torch.cat([k, k], 1)[:, :k_pos.shape[1]]
        v = torch.cat([v, v], 1)[:, :k_pos.shape[1]]
    q = rand_act(B, T, H, D, seed=seed + 4)
    sinks = torch.randn(H, generator=g).to(DEV)
    q_pos, k_pos = q_pos.to(DEV), k_pos.to(DEV)
    close(kernels.sink_attention(q, k, v, sinks, q_pos, k_pos, window),
          flint.sink_attention_ref(q, k, v, sinks, q_pos, k_pos, window))


@pytest.mark.parametrize("window, H, G, T", [(5, 4, 2, 11), (0, 8, 2, 11), (7, 4, 4, 11), (5, 4, 2, 40),
                                             (0, 4, 1, 40), (5, 4, 2, 12), (0, 4, 2, 14)])
def test_sink_attention_kernel(window, H, G, T):
    """Prefill attention: chunks of 11 to 40 queries (query blocks that skip keys) at positions 3 and 20, rings
    that wrap, empty slots, GQA groups 1..4; the last two put a row's newest key first in a 16-key block."""
    check_sink_attention(window, H, G, T, [3, 20], seed=window)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sink_attention_kernel_random(seed):
    """Random chunk lengths, start positions (a chunk may start at 0), windows and GQA shapes."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: int(torch.randint(0, n, (), generator=g))            # noqa: E731
    G = (1, 2, 4)[r(3)]
    check_sink_attention((0, 3, 9)[r(3)], G * (1, 2, 4)[r(3)], G, 1 + r(48), [r(60) for _ in range(1 + r(3))], seed)


@triton.jit
def _no_pdl():
    """Stands in for the PDL instructions in Triton's interpreter, which has none."""
    pass


@pytest.mark.parametrize("B, pdl", [(1, 0), (3, 0), (1, 2)])
@pytest.mark.parametrize("nvfp4", [False, True])
@pytest.mark.parametrize("chunk", [None, 16])
def test_moe_experts_kernel(B, pdl, nvfp4, chunk, monkeypatch):
    """chunk: rows read 16 elements at a time (4 steps of gate/up, 2 of down) instead of whole. pdl 2: one row as
    bf16 weights take it on SM90, where the down kernel routes the token itself (the launch order is the GPU's)."""
    E, A, C, I, S = 8, 3, 64, 32, 64
    if pdl:
        monkeypatch.setattr(kernels, "_pdl", lambda t: pdl)
        if kernels.INTERPRET:
            monkeypatch.setattr(kernels, "gdc_wait", _no_pdl)
            monkeypatch.setattr(kernels, "gdc_launch_dependents", _no_pdl)
    if chunk:
        tiles = kernels.tiles
        monkeypatch.setattr(kernels, "tiles", lambda *a: (tiles(*a)[0], chunk, tiles(*a)[2]))
    h = rand_act(B, C, seed=7)
    logits = rand_act(B, E, seed=8)
    logits[0, [2, 5, 6]] = logits[0].max() + 1                          # a three-way tie: lowest index first
    gate_up, down = rand_weight(E, 2 * I, C, nvfp4=nvfp4, seed=1), rand_weight(E, C, I, nvfp4=nvfp4, seed=2)
    sgate_up, sdown = rand_weight(2 * S, C, nvfp4=nvfp4, seed=3), rand_weight(C, S, nvfp4=nvfp4, seed=4)
    got = kernels.moe_experts(h, logits, gate_up, down, sgate_up, sdown, A, True)
    want = flint.moe_experts_ref(h, logits, gate_up, down, sgate_up, sdown, A, True)
    close(got, want)


@pytest.mark.parametrize("nvfp4", [False, True])
def test_matmul_kernel(nvfp4):
    """Prefill GEMM: rows and columns that are not multiples of the tiles, K not a power of 2, bf16 and fp32 out."""
    x, w = rand_act(37, 96, seed=1), rand_weight(50, 96, nvfp4=nvfp4, seed=2)
    close(kernels.matmul(x, w), flint.linear_ref(x, w))
    got = kernels.matmul(x, w, f32=True)
    assert got.dtype == torch.float32
    close(got, flint.linear_f32(x, w))


def compile_kernels_for_sm90():
    """Every kernel wrapper on CPU tensors of Flint's shapes (bf16 and NVFP4 weights, 1 and 64 rows, sliding and
    full attention, prompt chunks), with each launch replaced by compiling the kernel for sm_90 with the tiles the GPU
    gets (triton.compile; ptxas ships with triton). Returns the kernels built. Run without the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction
    assert not kernels.INTERPRET
    types = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
             torch.int32: "i32", torch.int64: "i64"}
    built, builds = [], []
    pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count())     # (ptxas runs apart from the GIL)

    def compile_only(self, *args, grid, warmup, **kwargs):
        values = dict(zip(self.arg_names, args), **{k: v for k, v in kwargs.items() if k in self.arg_names})
        sig, consts, attrs = {}, {}, {}
        for i, (name, param) in enumerate(zip(self.arg_names, self.params)):
            v = values[name]
            if param.is_constexpr:
                sig[name], consts[name] = "constexpr", v
            elif torch.is_tensor(v):
                sig[name] = "*" + types[v.dtype]
                aligned = v.data_ptr() % 16 == 0                         # as triton's JIT specializes
            else:
                sig[name] = "fp32" if isinstance(v, float) else "i64" if abs(v) >= 2**31 else "i32"
                aligned = isinstance(v, int) and v % 16 == 0
            if not param.is_constexpr and aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "launch_pdl")}
        builds.append(pool.submit(triton.compile, triton.compiler.ASTSource(self, sig, consts, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options))
        built.append(self.__name__)

    JITFunction.run = compile_only
    kernels._pdl_on = lambda t: True                                    # the decode kernels with PDL, as on SM90
    cfg = flint.Config(rope_theta=1e4)
    C, H, G, D, E, A = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 256, 6
    I, S, F_ = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.intermediate_size
    bf = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)      # noqa: E731  (never touched: lazy pages)
    for nvfp4 in (False, True):
        W = flint.NVFP4.empty if nvfp4 else bf
        for B in (1, 4, 8):                                             # 1; one multiply-sum per row; bf16
            x, nw = bf(B, C), bf(C)                                     # on tensor cores (16 rows), NVFP4 not
            kernels.add_norm_linear(x, x, nw, W((H + 2 * G) * D, C), 1e-6)
            kernels.linear(bf(B, H * D), W(C, H * D))
            kernels.add_norm_swiglu(x, x, nw, W(2 * F_, C), 1e-6)
            kernels.add_norm_linear(x, x, nw, W(32768, C), 1e-6, f32=True)   # lm_head tiles (N >= 32768)
            kernels.moe_experts(x, bf(B, E), W(E, 2 * I, C), W(E, C, I), W(2 * S, C), W(C, S), A, True)
        kernels.route(bf(64, E), A, True)                               # (compiled, not run: ids below)
        routing = torch.rand(64, A).to(torch.bfloat16), torch.randint(0, E, (64, A))
        kernels.experts(bf(64, C), *routing, W(E, 2 * I, C), W(E, C, I))
        kernels.matmul(bf(256, C), W((H + 2 * G) * D, C))
    kernels.add_norm_linear(bf(1, C), None, bf(C), bf(E, C), 1e-6)  # router
    cos, sin = flint.rope_table(cfg, 1024, "cpu")
    for B, window, slots in ((1, 513, 513), (1, 0, 1024), (1, 0, 8192), (64, 513, 513), (64, 0, 1024)):
        k = bf(B, slots, G, D)
        for w_o in (None, bf(C, H * D), flint.NVFP4.empty(C, H * D))[:3 if B == 1 else 1]:
            kernels.attention_decode(bf(B, (H + 2 * G) * D), bf(D), bf(D), torch.zeros(H), cos, sin, k, k,
                                     torch.zeros(B, dtype=torch.long), window, 1e-6, w_o)
        q_pos, k_pos = torch.arange(256)[None], torch.arange(512)[None]
        kernels.sink_attention(bf(1, 256, H, D), bf(1, 512, G, D), bf(1, 512, G, D), torch.zeros(H), q_pos, k_pos,
                               window)
    kernels.add_rms_norm(bf(256, C), bf(256, C), bf(C), 1e-6)
    for B in (1, 64):
        kernels.greedy_next(torch.empty(B, cfg.vocab_size), cfg.vocab_size, *torch.zeros(2, B, 1, dtype=torch.long))
    q, k, _ = bf(1, 256, H + 2 * G, D).split([H, G, G], dim=2)
    kernels.qk_norm_rope(q, k, bf(D), bf(D), cos[None, :256], sin[None, :256], 1e-6)
    for b in builds:
        b.result()                                                      # (raises a kernel's build error)
    pool.shutdown()
    return built


def test_kernels_compile_for_sm90():
    """The kernels compile for the H200 (sm_90) at Flint's shapes and the GPU's tiles, here on the CPU: a kernel
    that would fail to build on the GPU fails here first (with this machine's triton)."""
    code = "import json, test_flint; print(json.dumps(test_flint.compile_kernels_for_sm90()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                       env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    built = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert built == {name for name in dir(kernels) if name.endswith("_kernel")}, built


@pytest.mark.parametrize("norm", [True, False])
def test_route_kernel(norm):
    """Prefill routing: the same experts as route_ref (ties included: lowest index first) and the same weights
    (to one bf16 ulp: sigmoid in another library)."""
    logits = rand_act(37, 16, seed=8)
    logits[:5, 3:9] = 2.5                                               # six-way ties for the top 3
    logits[5] = 0.0
    logits[5, ::3] = -0.0                                               # -0 and +0 tie
    logits[6] = -3.0
    logits[6, 9:13] = -1.5                                              # negative logits, ties among them
    logits[7] = -logits[7].abs()                                        # all negative
    w, e = kernels.route(logits, 3, norm)
    w_ref, e_ref = flint.route_ref(logits, 3, norm)
    assert torch.equal(e, e_ref) and w.dtype == w_ref.dtype
    assert ((w.float() - w_ref.float()).abs() <= w_ref.float().abs() * 2**-7).all()


def test_greedy_next_kernel():
    """Greedy decoding's last op: the same ids as greedy_next_ref (ties across and within blocks: the first index;
    -0 and +0 tie; all -inf; the first n logits only; the row's largest logit past n ignored), the positions
    advanced, and launch after launch (the kernel resets its own state)."""
    g = torch.Generator().manual_seed(0)
    B, V, n = 5, 7 * kernels.GREEDY_BLOCK + 3, 6 * kernels.GREEDY_BLOCK + 5
    for launch in range(3):
        logits = torch.randn(B, V, generator=g)
        logits[0, [kernels.GREEDY_BLOCK + 1, 3 * kernels.GREEDY_BLOCK, 3 * kernels.GREEDY_BLOCK + 1]] = 9.0
        logits[1, n:] = 99.0                                            # past n: never picked
        logits[2] = float("-inf")
        logits[3] = 0.0
        logits[3, :n // 2] = -0.0
        logits[4, 5 * kernels.GREEDY_BLOCK + launch] = 50.0             # a different pick each launch
        logits = logits.to(DEV)
        ids, pos = torch.full((B, 1), -1, device=DEV), torch.arange(B, device=DEV)[:, None] * 100 + launch
        want_ids, want_pos = ids.clone(), pos.clone()
        got = kernels.greedy_next(logits, n, ids, pos)
        want = flint.greedy_next_ref(logits, n, want_ids, want_pos)
        assert torch.equal(got, want) and torch.equal(ids, want_ids) and torch.equal(pos, want_pos), (got, want)
        assert got.tolist()[:4] == [kernels.GREEDY_BLOCK + 1, got[1].item(), 0, 0]
        assert got[1] < n and got[4] == 5 * kernels.GREEDY_BLOCK + launch


def test_prompt_norm_kernels():
    """Prefill norms: residual add + RMSNorm rows (odd width, with and without the add), and per-head q/k RMSNorm
    + RoPE on q/k views into qkv rows (6 rows of 10 q heads: two blocks of 32 across rows, one partial), with and
    without RoPE. Each output is the reference's, or one bf16 ulp from it (the kernels sum squares in another
    order)."""
    def ulp_close(got, want):
        assert got.shape == want.shape and got.dtype == want.dtype
        err = (got.float() - want.float()).abs()
        assert (err <= want.float().abs() * 2**-7).all() and (err == 0).float().mean() > 0.9

    x, dx, w = rand_act(5, 96, seed=1), rand_act(5, 96, seed=2), rand_act(96, seed=3)
    for d in (dx, None):
        for got, want in zip(kernels.add_rms_norm(x, d, w, 1e-6), flint.add_rms_norm_ref(x, d, w, 1e-6)):
            ulp_close(got, want)
    B, T, H, G, D = 2, 3, 10, 2, 32
    q, k, _ = rand_act(B, T, H + 2 * G, D, seed=4).split([H, G, G], dim=2)
    q_norm, k_norm = rand_act(D, seed=5), rand_act(D, seed=6)
    ang = torch.rand(B, T, D // 2, generator=torch.Generator().manual_seed(7)).to(DEV) * 6
    for cos, sin in ((ang.cos(), ang.sin()), (None, None)):
        got = kernels.qk_norm_rope(q, k, q_norm, k_norm, cos, sin, 1e-6)
        for g, w_ in zip(got, flint.qk_norm_rope_ref(q, k, q_norm, k_norm, cos, sin, 1e-6)):
            assert g.is_contiguous()
            ulp_close(g, w_)


@pytest.mark.parametrize("nvfp4", [False, True])
def test_experts_grouped_kernel(nvfp4):
    """Prefill experts as grouped GEMMs: 40 tokens x top-3 of 8 experts, one expert chosen by none, one by most
    (more rows than a block), against the plain loop over experts."""
    N, E, A, C, I = 40, 8, 3, 64, 32
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, E, generator=g)
    logits[:, 5] = -9                                                   # nobody picks expert 5
    logits[:35, 2] = 9                                                  # nearly everybody picks expert 2
    weights, experts = flint.route_ref(logits.to(torch.bfloat16).to(DEV), A, True)
    x = rand_act(N, C, seed=5)
    gate_up, down = rand_weight(E, 2 * I, C, nvfp4=nvfp4, seed=1), rand_weight(E, C, I, nvfp4=nvfp4, seed=2)
    close(kernels.experts(x, weights, experts, gate_up, down), flint.experts_ref(x, weights, experts, gate_up, down))


@pytest.mark.parametrize("R,E,BLOCK_M", [(40, 8, 4), (1500, 16, 16), (5, 8, 16)])
def test_expert_blocks_kernel(R, E, BLOCK_M):
    """Rows sorted by expert as a stable sort does (1500 rows: several passes of the row loops), and each expert's
    rows cut into blocks of at most BLOCK_M that cover them exactly once; the other slots are spare."""
    flat = torch.randint(0, E, (R,), generator=torch.Generator().manual_seed(R))
    flat[flat == 3] = 4                                                 # an expert nobody picks
    order, expert, start, end = [t.cpu().long() for t in kernels._expert_blocks(flat.to(DEV), E, BLOCK_M)]
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert expert.numel() == -(-R // BLOCK_M) + E
    covered = torch.zeros(R, dtype=torch.long)
    for e, a, b in zip(expert.tolist(), start.tolist(), end.tolist()):
        if e >= 0:
            assert 0 <= a < b == int((flat <= e).sum()), (e, a, b)          # b: the end of e's rows
            rows = order[a:min(b, a + BLOCK_M)]
            assert (flat[rows] == e).all()
            covered[rows] += 1
    assert (covered == 1).all()


def tiny_model(nvfp4=False, seed=0):
    cfg = flint.Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, sliding_window=5,
                       rope_theta=10000.0)
    names = [n for n, _ in flint.Transformer(cfg, torch.bfloat16, "meta").weights()
             if n.endswith(load.NVFP4_WEIGHTS)] if nvfp4 else ()
    model = flint.init_random(flint.Transformer(cfg, torch.bfloat16, DEV, nvfp4=names), seed=seed, std=0.1)
    model.decode_ops = model.prefill_ops = flint.REFERENCE_OPS
    return model


def well_conditioned(model):
    """Random weights with small layer updates (a random deep net with large ones amplifies one-ulp differences
    into different router choices and tokens) and a decisive lm_head."""
    flint.init_random(model, seed=1, std=0.02)
    g = torch.Generator(device=model.device).manual_seed(2)            # seeded: the same weights in every run
    model.embed.data.normal_(0, 1.0, generator=g)
    if isinstance(model.lm_head, flint.NVFP4):
        model.lm_head.scales.copy_((model.lm_head.scales.float() * 16).to(torch.float8_e4m3fn))
    else:
        model.lm_head.data.normal_(0, 0.3, generator=g)
    return model


def checked_ops(worst, fast=None):
    """Ops that run the fast op (decode kernels, or `fast`) and the reference op on the same inputs, record the
    worst error of each output relative to its max |value| in `worst`, and continue on the reference's values.
    (Whole steps are not compared: a random model amplifies a one-ulp difference layer after layer, and a near-tie
    in a bf16 router logit then picks another expert.)"""
    fast = fast or flint.kernel_ops()

    def checked(name):
        def op(*args, **kw):
            want = getattr(flint.REFERENCE_OPS, name)(*[a.clone() if torch.is_tensor(a) else a for a in args], **kw)
            got = getattr(fast, name)(*args, **kw)
            for i, (g, w) in enumerate(zip(*[r if isinstance(r, tuple) else (r,) for r in (got, want)])):
                close(g, w)
                err = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                worst[f"{name}[{i}]"] = max(worst.get(f"{name}[{i}]", 0.0), err)
            return want
        return op
    return SimpleNamespace(**{name: checked(name) for name in vars(flint.REFERENCE_OPS)})


@pytest.mark.parametrize("nvfp4,grouped", [(False, False), (True, False), (False, True)])
def test_decode_kernels_match_reference_path(nvfp4, grouped, monkeypatch):
    """Decode steps of a tiny model across the ring's wrap: inside each step, every Triton op on the reference
    op's inputs (the cache included) agrees with it to bf16 rounding, and writes the same cache entries. grouped:
    the weight ops as at large batch (GEMMs; the MoE's tokens grouped by expert)."""
    if grouped:
        monkeypatch.setattr(flint, "GEMM_MIN_ROWS", 2)
    model = tiny_model(nvfp4)
    B, T = 2, 9
    ids = torch.randint(0, 300, (B, T + 4), generator=torch.Generator().manual_seed(0)).to(DEV)
    cache = flint.KVCache(model.cfg, B, 32, torch.bfloat16, DEV)
    model(ids[:, :T], torch.arange(T, device=DEV)[None].expand(B, T), cache)
    worst = {}
    model.decode_ops = checked_ops(worst)
    for t in range(T, T + 2):
        model(ids[:, t:t + 1], torch.full((B, 1), t, device=DEV), cache)
    assert set(worst) >= {"add_norm_linear[2]", "attention_decode[0]", "moe_experts[0]"}, worst


@pytest.mark.parametrize("nvfp4", [False, True])
def test_prefill_kernels_match_reference_path(nvfp4):
    """Chunked prefill of a tiny model with prefill_ops (Triton attention and grouped experts) across the ring's
    wrap: inside each chunk every op on the reference op's inputs agrees with it to bf16 rounding; and, with
    well-conditioned weights, the chunks prefilled on their own, then one decode step, agree with a full recompute
    on the reference ops."""
    model = tiny_model(nvfp4)
    B, T = 2, 24                                                        # chunks of 7, 11 and 5 (GEMMs from
    chunks = [(0, 7), (7, 18), (18, T - 1)]                             # 9 rows), over the ring of 5 slots
    ids = torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(0)).to(DEV)
    pos = torch.arange(T, device=DEV)[None].expand(B, T)
    worst = {}
    model.prefill_ops = checked_ops(worst, flint.prefill_ops())
    cache = flint.KVCache(model.cfg, B, T, torch.bfloat16, DEV)
    for a, b in chunks:
        model(ids[:, a:b], pos[:, a:b], cache)
    assert set(worst) >= {"sink_attention[0]", "moe_experts[0]", "qk_norm_rope[0]", "qk_norm_rope[1]"}, worst
    well_conditioned(model)
    model.prefill_ops = flint.REFERENCE_OPS
    full = model(ids, pos)
    model.prefill_ops = flint.prefill_ops()
    cache = flint.KVCache(model.cfg, B, T, torch.bfloat16, DEV)
    # the last chunk asks for its last token's logits only (strided rows into the decode kernel; bf16 only: the
    # two-row NVFP4 GEMV takes a minute in the interpreter), then a decode step
    last_only = not nvfp4
    got = [model(ids[:, a:b], pos[:, a:b], cache, last_only=last_only and b == T - 1) for a, b in chunks]
    got.append(model(ids[:, T - 1:], pos[:, T - 1:], cache))
    want = full[:, [*range(chunks[-1][0]), T - 2, T - 1]] if last_only else full
    close(torch.cat(got, 1), want)


def test_decode_step_keeps_its_output_through_the_next():
    """A decode step's output (the next step's input) is still intact after the next step, which generate.decode
    relies on to copy it to the host beside that step; and that step went on from it, as one given it does."""
    model = tiny_model()
    ids, pos = torch.tensor([5, 7], device=DEV), torch.zeros(2, dtype=torch.long, device=DEV)
    step = flint.DecodeStep(model, flint.KVCache(model.cfg, 2, 16, torch.bfloat16, DEV), 0.0, 0, 1.0, graph=False)
    first = step(ids, pos)
    kept = first.clone()
    second = step()
    assert torch.equal(first, kept) and first.data_ptr() != second.data_ptr()
    fresh = flint.DecodeStep(model, flint.KVCache(model.cfg, 2, 16, torch.bfloat16, DEV), 0.0, 0, 1.0, graph=False)
    assert torch.equal(fresh(ids, pos), kept)
    assert torch.equal(fresh(kept, pos + 1), second)


@cuda
@pytest.mark.parametrize("nvfp4,grouped", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_graph_generation_matches_reference(nvfp4, grouped, monkeypatch):
    """Greedy: 64 tokens from CUDA-graph replays of the Triton path equal the eager reference path's (grouped:
    with the MoE as at large batch, tokens grouped by expert inside the graph)."""
    from generate import generate
    if grouped:
        monkeypatch.setattr(flint, "GEMM_MIN_ROWS", 2)
    model = well_conditioned(tiny_model(nvfp4, seed=1))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    out = []
    for ops, graph in [(flint.REFERENCE_OPS, False), (flint.kernel_ops(), True), (flint.kernel_ops(), False)]:
        model.decode_ops = ops
        model.prefill_ops = flint.REFERENCE_OPS if ops is flint.REFERENCE_OPS else flint.prefill_ops()
        cache = flint.KVCache(model.cfg, 2, 80, torch.bfloat16, DEV)
        out.append(torch.stack([t.clone() for t in generate(model, cache, prompts, 64, 0.0, 0, 1.0, graph=graph)]))
    assert torch.equal(out[1], out[2]), "graph replay differs from eager"
    assert torch.equal(out[1], out[0]), f"fast path differs from the reference: {(out[1] != out[0]).sum()} tokens"


def confident(model):
    """Random weights whose next token is confident, as a trained model's mostly is: the embedding of token t is
    (4 x, normalized) the lm_head row of another token succ(t), so the last hidden state, which still carries the
    input's embedding next to the 49 layers' updates, points at one lm_head row. With init_random's lm_head the
    150K logits are near-ties (the largest of 150K Gaussians), and bf16 noise alone, the reference against itself
    in a batch of 2, changes the top-1 token of 2-5% of the steps (measured on the H200)."""
    flint.init_random(model, seed=1, std=0.02)
    g = torch.Generator(device=model.device).manual_seed(2)            # seeded: the same weights in every run
    w = model.lm_head
    w = w.dequantize() * w.row_scale[:, None] if isinstance(w, flint.NVFP4) else w.float()
    rows = w[torch.randperm(w.shape[0], generator=g, device=model.device)]
    model.embed.data.copy_(rows * 4 / rows.pow(2).mean(-1, keepdim=True).sqrt())
    return model


@cuda
@pytest.mark.parametrize("nvfp4", [False, True])
def test_gpu_full_size_decode_ops(nvfp4):
    """Full-size random Flint after a 600-token prompt (the rings have wrapped): in one decode step, every Triton
    op on the reference op's inputs agrees with it to bf16 rounding. Then 100 teacher-forced steps, each path on its
    own cache, with confident next tokens: the fast path against the reference, and, as the yardstick of bf16
    noise, the reference against itself inside a batch of 2 (the same math; cuBLAS sums in another order). A random
    deep model amplifies one-ulp differences layer after layer, so the fast path's logits may differ as much as the
    yardstick's, not more (a 5% error in one op doubles the mean difference); top-1 must agree on 99% of the steps."""
    cfg = flint.Config(rope_theta=10000.0)
    names = [n for n, _ in flint.Transformer(cfg, torch.bfloat16, "meta").weights()
             if n.endswith(load.NVFP4_WEIGHTS)]
    shapes = flint.Transformer(cfg, torch.bfloat16, "meta", nvfp4=names if nvfp4 else ())
    need = sum(t.numel() * t.element_size() for t in shapes.state_dict().values()) + 8 * 2**30  # + the paths' work
    have = torch.cuda.get_device_properties(DEV).total_memory
    if have < need:                      # (bf16 on an 80 GB H100: the weights alone take 74 of its 79 GiB)
        pytest.skip(f"the full-size {'nvfp4' if nvfp4 else 'bf16'} model needs about {need / 2**30:.0f} GiB of GPU "
                    f"memory, this GPU has {have / 2**30:.0f} GiB (an H200 has 139)")
    model = flint.init_random(flint.Transformer(cfg, torch.bfloat16, DEV, nvfp4=names if nvfp4 else ()))
    ids = torch.randint(0, cfg.vocab_size, (1, 700), generator=torch.Generator().manual_seed(0)).to(DEV)

    def prefilled():
        cache = flint.KVCache(cfg, 1, 704, torch.bfloat16, DEV)
        model.decode_ops = flint.REFERENCE_OPS
        model(ids[:, :600], torch.arange(600, device=DEV)[None], cache)
        return cache

    worst, cache = {}, prefilled()
    model.decode_ops = checked_ops(worst)
    model(ids[:, 600:601], torch.tensor([[600]], device=DEV), cache)
    print("\nworst relative error per op:", {k: round(v, 4) for k, v in worst.items()})
    assert max(worst.values()) <= 0.02

    confident(model)
    prompt = prefilled()

    def steps(ops, B):
        cache = flint.KVCache(cfg, B, 704, torch.bfloat16, DEV)
        for c, p in zip(cache.k + cache.v, prompt.k + prompt.v):
            c.copy_(p.expand_as(c))
        model.decode_ops = ops
        return torch.cat([model(ids[:, t:t + 1].expand(B, 1), torch.full((B, 1), t, device=DEV), cache)[:1, 0]
                          for t in range(600, 700)]).float()
    ref = steps(flint.REFERENCE_OPS, 1)
    mean, agree = {}, {}
    for name, got in [("fast path vs reference", steps(flint.kernel_ops(), 1)),
                      ("reference in a batch of 2 vs alone", steps(flint.REFERENCE_OPS, 2))]:
        diff = (got - ref).abs()
        mean[name] = diff.mean().item()
        agree[name] = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"full-size {'nvfp4' if nvfp4 else 'bf16'}, 100 teacher-forced steps, {name}: max |diff| "
              f"{diff.max().item():.4f}, mean {mean[name]:.5f} (mean |logit| {ref.abs().mean().item():.4f}), "
              f"top-1 agreement {agree[name]:.3f}")
    assert mean["fast path vs reference"] <= 1.25 * mean["reference in a batch of 2 vs alone"], mean
    assert agree["fast path vs reference"] >= 0.99, agree


# -----------------------------------------------------------------------------
# GPU


@cuda
def test_gpu_logits_match_transformers(hf_tiny):
    hf, path = hf_tiny
    model = flint_from(path, torch.float32, "cuda")
    ids = torch.randint(0, 320, (2, 19))
    with torch.no_grad():
        want = hf(ids).logits
    got = model(ids.cuda(), torch.arange(19, device="cuda")[None].expand(2, 19)).cpu()
    assert (got - want).abs().max() <= 1e-4


@cuda
def test_gpu_generate_tiny_bf16():
    r = run_generate("-c", "tiny", "-p", "hello", "-n", "32", "--device", "cuda", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) > 0


# -----------------------------------------------------------------------------
# chat.py


def test_chat_cache_reuse_equals_fresh_prefill():
    """A turn prefills only what the cache lacks (an extension, or a rewind to the last prefill's end whose
    sliding rings were kept), and its logits equal a fresh prefill of the whole conversation; past the 33-key
    window of the tiny model, so the rings wrap."""
    import chat
    ckpt = load.load("tiny", "cpu", torch.float32)
    settings = dict(temperature=0.0, top_p=1.0, top_k=0, max_tokens=12)
    c = chat.Chat(ckpt, 512, settings, graph=False)
    g = torch.Generator().manual_seed(0)
    a, b, r, d = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (40, 30, 20, 25)]

    def fresh(ids):
        return chat.Chat(ckpt, 512, settings, graph=False).start(ids)
    for ids, prefilled in [(a, 40), (a + b, 30), (a + b, 0)]:         # fresh, extension, the same prompt (/regen)
        torch.testing.assert_close(c.start(ids), fresh(ids), atol=1e-4, rtol=0)
        assert c.prefilled == prefilled
    for i, t in enumerate(r):                                       # decode a reply into the cache
        c.step(torch.tensor([t]), torch.tensor([70 + i]))
        c.cached.append(t)
    other = a + b + r[::-1] + d                                      # the template rendered the reply otherwise
    torch.testing.assert_close(c.start(other), fresh(other), atol=1e-4, rtol=0)
    assert c.prefilled == len(r) + len(d)
    for i, t in enumerate(r):                                       # another reply, then a prompt that drops
        c.step(torch.tensor([t]), torch.tensor([len(other) + i]))    # the last token of the one before
        c.cached.append(t)
    again = other[:-1] + d
    torch.testing.assert_close(c.start(again), fresh(again), atol=1e-4, rtol=0)
    assert c.prefilled == len(d)
    torch.testing.assert_close(c.start(d + a), fresh(d + a), atol=1e-4, rtol=0)   # nothing shared: from 0
    assert c.prefilled == len(d + a)

    # whole greedy turns: each reply from the reused cache equals the reply to a fresh prefill of the conversation
    for i, (reused, alone) in enumerate(turns_against_fresh(ckpt, settings)):
        assert alone["prefilled"] > reused["prefilled"] or i == 0               # turns 2, 3 reuse


def turns_against_fresh(ckpt, settings, texts=("hello", "tell me more", "and again")):
    """Greedy chat turns on one reused cache, each reply checked equal to the reply of a fresh Chat to the same
    conversation; returns the two replies' stats (Chat.reply) per turn."""
    import io
    import chat
    reused, turns = chat.Chat(ckpt, 512, settings, graph=False), []
    for text in texts:
        reused.messages.append({"role": "user", "content": text})
        stats = reused.reply(chat.Printer(io.StringIO(), False, False))
        alone = chat.Chat(ckpt, 512, settings, graph=False)
        alone.messages = reused.messages[:-1]
        turns.append((stats, alone.reply(chat.Printer(io.StringIO(), False, False))))
        assert alone.messages[-1] == reused.messages[-1]
    return turns


def test_chat_reply_stopped_by_eos_then_next_turn(monkeypatch):
    """A reply that stops on EOS has fed that token too (each step is queued before the host reads the token
    before it): the turns after it still equal replies to fresh prefills of the conversation."""
    import io
    import chat
    ckpt = load.load("tiny", "cpu", torch.float32)
    settings = dict(temperature=0.0, top_p=1.0, top_k=0, max_tokens=12)
    probe = chat.Chat(ckpt, 512, settings, graph=False)
    probe.messages.append({"role": "user", "content": "hello"})
    prompt = len(probe.tok.encode(probe.render(probe.messages)))
    probe.reply(chat.Printer(io.StringIO(), False, False))
    eos = probe.cached[prompt + 4]                                   # the reply's 5th token ends it from now on
    monkeypatch.setattr(ckpt.tokenizer, "eos_ids", set(ckpt.tokenizer.eos_ids) | {eos})
    stats = turns_against_fresh(ckpt, settings)[0][0]
    assert stats["stop"] is None and stats["tokens"] <= 5, stats                  # the first stopped on the EOS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ids_past_the_tokenizer_never_sampled(temperature):
    """A model with more vocab rows than the tokenizer has ids (spec: mask the missing ids' logits), the padding
    rows given the highest logits: chat and generate never sample them. Chat samples its first token from the
    prefill's logits, outside inference mode."""
    import dataclasses
    import io
    import chat
    import generate
    ckpt = load.load("tiny", "cpu", torch.float32)
    n, m = ckpt.tokenizer.n_vocab, ckpt.model
    big = flint.Transformer(dataclasses.replace(m.cfg, vocab_size=n + 16), torch.float32, "cpu")
    state = m.state_dict()
    g = torch.Generator().manual_seed(0)
    pad = torch.randn(8, m.cfg.hidden_size, generator=g) * 1000.0
    state["embed"] = torch.cat([state["embed"], torch.zeros(16, m.cfg.hidden_size)])
    state["lm_head"] = torch.cat([state["lm_head"], pad, -pad])                 # one of +-r wins any token
    big.load_state_dict(state)
    settings = dict(temperature=temperature, top_p=1.0, top_k=0, max_tokens=6)
    c = chat.Chat(SimpleNamespace(model=big, tokenizer=ckpt.tokenizer, chat_template=ckpt.chat_template), 64,
                  settings, graph=False)
    c.messages.append({"role": "user", "content": "hello"})
    c.reply(chat.Printer(io.StringIO(), False, False))
    assert len(c.cached) > 6 and max(c.cached) < n
    with torch.inference_mode():
        assert big(torch.tensor([c.cached[:4]]), torch.arange(4)[None])[0, -1].argmax() >= n   # (the padding wins)
    cache = flint.KVCache(big.cfg, 1, 64, torch.float32, "cpu")
    out = list(generate.generate(big, cache, [ckpt.tokenizer.encode("hi")], 6, temperature, 0, 1.0, n_vocab=n,
                                 graph=False))
    assert len(out) == 6 and max(int(t.max()) for t in out) < n


def test_chat_reasoning_display_and_message():
    """<think> tags split over tokens: reasoning shown apart, or hidden; the message keeps it in reasoning_content."""
    import io
    import chat
    chunks = ["<th", "ink>Let me", " see.</th", "ink>\n\nIt is", " 4."]
    for hide, want in [(False, "Let me see.\nIt is 4.\n"), (True, "thinking...\nIt is 4.\n")]:
        out = io.StringIO()
        p = chat.Printer(out, hide, color=False)
        p.begin(False)
        for c in chunks:
            p.write(c)
        p.end()
        assert out.getvalue() == want
    text = "".join(chunks)
    assert chat.assistant_message(text, False) == {"role": "assistant", "content": "It is 4.",
                                                   "reasoning_content": "Let me see."}
    assert chat.assistant_message(text[len("<think>"):], True) == chat.assistant_message(text, False)
    assert chat.assistant_message("plain", False) == {"role": "assistant", "content": "plain"}


class Terminal:
    """chat.py on a pseudo-terminal, driven like a person at a keyboard."""

    def __init__(self, *args, cwd=HERE):
        import pty
        import warnings
        with warnings.catch_warnings():                              # the child only execs: forking is safe
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid, self.fd = pty.fork()
        if self.pid == 0:                                            # the child: chat.py on the terminal
            os.chdir(cwd)
            # as a shell starts a program in the foreground; pytest run in the background (`cmd &`, nohup) has
            # SIGINT ignored, which exec keeps, and Python then keeps ignoring Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(sys.executable, [sys.executable, str(HERE / "chat.py"), *args])
        self.seen = ""

    def expect(self, pattern, timeout=120):
        """Read until pattern (a regex) shows; return what came up to it."""
        import select
        deadline = time.time() + timeout
        while (m := re.search(pattern, self.seen)) is None:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.time()))
            if not ready:
                raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.seen[-3000:]}")
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                raise AssertionError(f"chat.py exited before {pattern!r}; the terminal shows:\n{self.seen[-3000:]}")
            self.seen += data.decode(errors="replace")
        text, self.seen = self.seen[:m.end()], self.seen[m.end():]
        return text

    def line(self, text, then=r"\[\d+ tokens \|[^\]]*\]", prompt=r"\n> "):
        """Type a line, wait for `then` (by default a reply's stats line) and the next prompt (typing ahead would
        race with Ctrl-C, which drops typed-ahead input, as terminals do)."""
        os.write(self.fd, text.encode() + b"\r")
        out = self.expect(then)
        return out + (self.expect(prompt) if prompt else "")

    def exit_status(self, timeout=60):
        """chat.py's exit code; killed and failed if it has not exited within timeout seconds."""
        deadline = time.time() + timeout
        while (done := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
            if time.time() > deadline:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
                raise AssertionError(f"chat.py did not exit; the terminal shows:\n{self.seen[-3000:]}")
            time.sleep(0.05)
        return os.waitstatus_to_exitcode(done[1])


def test_chat_session_on_a_terminal(tmp_path):
    """Turns, /set, /regen, /save, /clear, /load, multi-line input, Ctrl-C in a reply and at the prompt, a
    message too long for the context, the history file, Ctrl-D: all on the tiny model through a terminal."""
    history = tmp_path / "history"
    t = Terminal("-c", "tiny", "-t", "0", "-n", "20", "--max-seq-len", "600", "--history", str(history),
                 "--device", "cpu")
    t.expect(r"/help for commands[^>]*> ")
    first = t.line("hello")
    assert "| prompt 8 (8 new)" in first                             # <|user|>hello<|end|><|assistant|>
    second = t.line("and again")
    n_prompt, n_new = map(int, re.search(r"prompt (\d+) \((\d+) new\)", second).groups())
    assert n_prompt > 8 and n_new < n_prompt                   # the first turn came from the cache
    assert "(0 new)" in t.line("/regen")
    assert "temperature 0.0  top_p 0.95  top_k 20" in t.line("/set", then=r"top_k 20  max_tokens 20")
    t.line("/save talk.json".replace("talk.json", str(tmp_path / "talk.json")), then=r"saved 4 messages")
    t.line("/clear", then=r"new conversation")
    assert "prompt 8 (8 new)" in t.line("howdy")
    t.line(f"/load {tmp_path / 'talk.json'}", then=r"loaded 4 messages")
    assert int(re.search(r"prompt (\d+)", t.line("go on")).group(1)) > n_prompt
    t.line('"""', then=r"\.\.\. ", prompt=None)
    t.line("two lines", then=r"\.\.\. ", prompt=None)
    t.line('of text"""')
    t.line(f"/save {tmp_path / 'talk2.json'}", then=r"saved 8 messages")
    saved = json.loads((tmp_path / "talk2.json").read_text())
    assert saved["messages"][6] == {"role": "user", "content": "two lines\nof text"}
    t.line("/set max_tokens 5000", then=r"top_k 20  max_tokens 5000")
    t.line("/clear", then=r"new conversation")
    os.write(t.fd, b"count to a thousand\r")                         # 986 greedy tokens: stop it once it streams
    t.expect(r"thousand\r\n.")
    os.write(t.fd, b"\x03")
    assert "interrupted" in t.expect(r"\[\d+ tokens \|[^\]]*\]") + t.expect(r"\n> ")
    t.line("/set max_tokens 20", then=r"top_k 20  max_tokens 20")
    assert "interrupted" not in t.line("and now the rest")          # the chat goes on
    t.line("x" * 700, then=r"error: the conversation is \d+ tokens and the context holds 600")
    t.line("/bogus", then=r"unknown command /bogus")
    time.sleep(0.5)             # (a Ctrl-C between readline's prompt and its wait for keys is seen at the next key)
    os.write(t.fd, b"\x03")
    t.expect(r"Ctrl-D or /exit quits[^>]*> ")
    time.sleep(0.5)                                                  # (as above: let readline take the keys)
    os.write(t.fd, b"\x04")
    assert t.exit_status() == 0
    assert "hello" in history.read_text()


THINK_TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'system' -%}{{ m.content }}
{%- elif m.role == 'user' -%}<|user|>{{ m.content }}
{%- else -%}<|assistant|>{% if loop.last and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{- m.content }}<|endoftext|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"""


def test_chat_checkpoints_thinking_and_full_context(hf_tiny, nvfp4_tiny, tmp_path):
    """A BF16 directory whose template opens the reasoning and drops it from past turns (the next turn rewinds
    to the last prefill's end), --hide-thinking, a reply that fills the context, a message that does not fit;
    then a GGUF file whose template refuses a loaded conversation."""
    import shutil
    d = Path(shutil.copytree(hf_tiny[1], tmp_path / "bf16"))
    (d / "chat_template.jinja").write_text(THINK_TEMPLATE)
    t = Terminal("-c", str(d), "-t", "0", "-n", "12", "--hide-thinking", "--max-seq-len", "90", "--history", "",
                 "--device", "cpu")
    t.expect(r"/help for commands[^>]*> ")
    first = t.line("hi")
    assert "thinking..." in first                                    # the prompt ends in <think>: all reasoning
    n_first = int(re.search(r"prompt (\d+) \(\1 new\)", first).group(1))
    second = t.line("more please")
    n_prompt, n_new = map(int, re.search(r"prompt (\d+) \((\d+) new\)", second).groups())
    assert n_new == n_prompt - (n_first - 1)                         # rewound to the first prompt's <think>
    t.line("/set max_tokens 500", then=r"max_tokens 500")
    assert "the context is full" in t.line("go on")
    t.line("and then " * 30, then=r"error: the conversation is \d+ tokens and the context holds 90")
    t.line("/clear", then=r"new conversation")
    assert f"prompt {n_first} ({n_first} new)" in t.line("hi")
    os.write(t.fd, b"/exit\r")
    assert t.exit_status() == 0

    path = write_gguf(tmp_path / "flint.gguf", *gguf_contents(nvfp4_tiny)[:2])
    (tmp_path / "talk.json").write_text(json.dumps([{"role": "user", "content": "call it"},
                                                    {"role": "tool", "content": "42"}]))
    t = Terminal("-c", str(path), "-n", "4", "--history", "", "--device", "cpu")
    t.expect(r"/help for commands[^>]*> ")
    t.line(f"/load {tmp_path / 'talk.json'}", then=r"loaded 2 messages")
    t.line("so?", then=r"error: chat template error: no tools here: 42; this message was not sent")
    t.line("/clear", then=r"new conversation")
    assert "tokens | prompt" in t.line("hello")
    os.write(t.fd, b"\x04")
    assert t.exit_status() == 0


@cuda
def test_gpu_chat_tiny():
    """chat.py on the GPU: CUDA-graph decode, a rebuilt graph after /set, cache reuse across turns."""
    t = Terminal("-c", "tiny", "-n", "16", "--history", "", "--device", "cuda")
    t.expect(r"/help for commands[^>]*> ")
    assert "tokens | prompt" in t.line("hello")
    t.line("/set temperature 0.5", then=r"temperature 0.5  ")
    second = t.line("and again")
    n_prompt, n_new = map(int, re.search(r"prompt (\d+) \((\d+) new\)", second).groups())
    assert n_new < n_prompt
    assert "(0 new)" in t.line("/regen")
    os.write(t.fd, b"\x04")
    assert t.exit_status() == 0


def test_bench_breakdown_tiny():
    """bench.py's decode breakdown runs every op of a step (here the tiny model's: eagerly on the CPU, on CUDA the
    fast ops in CUDA graphs, as bench.py runs it): one row per op kind, times positive, shares summing to the whole
    step."""
    import bench
    model = tiny_model()
    if DEV == "cuda":                                                   # the reference ops sync: not capturable
        model.decode_ops = flint.kernel_ops()
    rows, t = bench.breakdown(model, 2, 7, iters=2)
    assert [r["op"] for r in rows] == ["qkv: add + norm + GEMV", "attention + o_proj, sliding",
                                       "attention + o_proj, full", "dense MLP", "router: add + norm + GEMV", "experts",
                                       "lm_head", "between ops"]
    assert t > 0 and all(r["us_step"] > 0 for r in rows[:-1])
    assert abs(sum(r["share"] for r in rows) - 100) < 1e-6
