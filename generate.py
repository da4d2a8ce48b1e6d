"""Generate text with Flint: python generate.py --checkpoint RecursiveSI/flint --prompt "Hello"

Only the generated text goes to stdout (so it pipes); one stats line goes to stderr.
"""
import argparse
import json
import sys
import time

import torch

import flint
import load


PREFILL_CHUNK = 8192                    # tokens per prefill forward (measured: see README); bounds activation memory


def sampling_expects(name, v):
    """None if v suits the sampling setting `name` (the flags, generation_config.json, chat.py's /set), else what
    that setting expects."""
    if not isinstance(v, (int, float)):
        return "a number"
    if name == "temperature":
        return None if v >= 0 else "0 (greedy) or more"
    if name == "top_k":
        return None if v >= 0 and v == int(v) else "a whole number, 0 (off) or more"
    return None if 0 < v <= 1 else "above 0, at most 1 (1 = off)"


@torch.inference_mode()
def prefill(model, cache, ids, start=0, chunk_size=PREFILL_CHUNK):
    """Run token ids (a list) at positions start, start+1, ... of a one-row cache, in chunks; fp32 logits [1, V]
    of the last one."""
    dev = model.device
    for i in range(0, len(ids), chunk_size):
        chunk = ids[i:i + chunk_size]
        pos = torch.arange(start + i, start + i + len(chunk), device=dev)[None]
        logits = model(torch.tensor([chunk], device=dev), pos, cache, last_only=True)[:, -1]
    return logits


@torch.inference_mode()
def generate(model, cache, prompts, max_new_tokens, temperature, top_k, top_p, n_vocab=None, graph=True):
    """Prefill each prompt (lists of token ids) into its row of the cache, then decode all rows together, one
    CUDA-graph replay per token on the GPU. Yields the sampled ids [B] (a CPU tensor) once per step; the caller
    decides when to stop (a step queued past the stop writes one more cache slot, which nothing reads)."""
    dev = model.device
    step = flint.DecodeStep(model, cache, temperature, top_k, top_p, n_vocab, graph=graph and dev.type == "cuda")
    logits = [prefill(model, cache.row(b), ids) for b, ids in enumerate(prompts)]   # lengths differ: one by one
    tok = step.sample(torch.cat(logits))                                # [B]
    pos = torch.tensor([len(ids) for ids in prompts], device=dev)       # [B] next position per row
    yield from decode(step, tok, pos, max_new_tokens)


def decode(step, tok, pos, n):
    """Yields the ids tok [B] (on the device, at positions pos [B]), then those of the n - 1 decode steps that
    follow them, each as a CPU tensor. Each step is queued on the GPU before the ids of the one before are read
    back, and those are copied on a side stream while it runs, so the GPU never waits for the host, nor for a copy,
    between tokens. (DecodeStep keeps a step's output until the step after next, which is queued only once its copy
    is done.)"""
    cuda = tok.device.type == "cuda"
    host = torch.empty(tok.shape, dtype=torch.long, pin_memory=cuda)   # the ids come back through it
    copier = torch.cuda.Stream(tok.device) if cuda else None
    copied = torch.cuda.Event() if cuda else None
    for i in range(n):
        if cuda:
            copier.wait_stream(torch.cuda.current_stream())             # (after the step that wrote tok)
            tok.record_stream(copier)                                   # (no reuse of its memory before)
            with torch.cuda.stream(copier):
                host.copy_(tok, non_blocking=True)
                copied.record()
        else:
            host.copy_(tok)
        if i + 1 < n:      # the next step, queued before this one's ids are read: it starts at tok, pos
            tok = step() if i else step(tok, pos)   # then goes on from its own output (a static buffer)
        if cuda:
            copied.synchronize()                                        # (the copy only, not the step after it)
        yield host.clone()


def read_prompts(args):
    if args.prompt_file:
        text = sys.stdin.read() if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8").read()
        prompts = [line for line in text.splitlines() if line.strip()]  # one prompt per line, decoded as a batch
    else:
        prompts = [sys.stdin.read() if args.prompt == "-" else args.prompt]
    if not prompts:
        raise ValueError("no prompt: --prompt-file holds no non-empty line")
    if len(prompts) > flint.MAX_DECODE_BATCH:
        raise ValueError(f"--prompt-file holds {len(prompts)} prompts, and one batch decodes at most "
                         f"{flint.MAX_DECODE_BATCH}; split the file")
    return prompts


def usable_device(name):
    """torch.device(name), checked to exist on this machine before anything loads onto it."""
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:                         # (no CUDA: torch raises AssertionError)
        cuda = "; this torch sees no CUDA GPU" if name.startswith("cuda") and not torch.cuda.is_available() else ""
        why = str(e).splitlines()[0].split(". ")[0]                     # (torch's first sentence)
        raise ValueError(f"--device {name}: not usable here{cuda} ({why}); use --device cpu, or cuda on a machine "
                         f"with an NVIDIA GPU") from None
    return device


def load_model(args):
    """The checkpoint and the sampling settings that the shared flags (add_model_args) ask for; seeds torch."""
    flag = {k: "--" + k.replace("_", "-") for k in load.SAMPLING_DEFAULTS}
    given = {k: getattr(args, k) for k in flag if getattr(args, k) is not None}
    for k, v in given.items():                                          # the flags, before the (long) load
        if expected := sampling_expects(k, v):
            raise ValueError(f"{flag[k]} {v}: expected {expected}")
    torch.manual_seed(args.seed)
    device = usable_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ckpt = load.load(args.checkpoint, device, dtype)
    for k in flag:                                                      # the checkpoint's defaults
        if k not in given and (expected := sampling_expects(k, ckpt.sampling[k])):
            raise ValueError(f"{ckpt.name}: its default {k} {ckpt.sampling[k]} (generation_config.json or the GGUF "
                             f"metadata) is not {expected}; override it with {flag[k]}")
    return ckpt, {**ckpt.sampling, **given}


def main(args):
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: expected 1 or more")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise ValueError(f"--max-seq-len {args.max_seq_len}: expected 2 or more (the KV cache length)")
    prompts = read_prompts(args)
    ckpt, sampling = load_model(args)
    model, tok, cfg = ckpt.model, ckpt.tokenizer, ckpt.model.cfg
    device, dtype = model.device, model.dtype
    if args.chat:
        if ckpt.chat_template is None:
            raise ValueError(f"--chat: checkpoint {ckpt.name} has no chat template (chat_template.jinja or "
                             f"tokenizer_config.json); drop --chat to send the raw prompt")
        prompts = [load.render_chat(ckpt.chat_template, [{"role": "user", "content": p}], tokenizer=tok)
                   for p in prompts]
    ids = [tok.encode(p) for p in prompts]
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else cfg.max_position_embeddings
    longest = max(len(i) for i in ids)
    if longest == 0:
        raise ValueError("the prompt is empty after tokenization; give at least one token of text")
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds the model's context of {cfg.max_position_embeddings} "
                         f"tokens (max_position_embeddings); lower it")
    if longest + args.max_new_tokens > max_seq_len:
        raise ValueError(f"prompt ({longest} tokens) + --max-new-tokens {args.max_new_tokens} exceeds --max-seq-len "
                         f"{max_seq_len}; raise --max-seq-len (at most {cfg.max_position_embeddings}) or shorten the "
                         f"prompt or the output")
    # The cache holds what this run can reach, not the model's whole context
    cache = flint.KVCache(cfg, len(ids), min(max_seq_len, longest + args.max_new_tokens), dtype, device)

    stream = len(ids) == 1 and not args.json
    decoder = load.StreamDecoder(tok)
    out = [[] for _ in ids]
    t0 = time.perf_counter()
    t_first, done = None, [False] * len(ids)
    for t in generate(model, cache, ids, args.max_new_tokens, n_vocab=tok.n_vocab, graph=not args.no_graph,
                      **sampling):
        t = t.tolist()
        t_first = t_first or time.perf_counter()
        for b, tb in enumerate(t):
            if not done[b]:
                out[b].append(tb)
                done[b] = tb in tok.eos_ids
        if stream and not done[0]:
            print(decoder.push(t[0]), end="", flush=True)
        if all(done):
            break
    t_end = time.perf_counter()
    if stream:
        print(decoder.flush(), flush=True)

    n_prompt = sum(len(i) for i in ids)
    n_new = sum(len(o) for o in out)
    ttft = t_first - t0
    decode_tps = (n_new - len(out)) / (t_end - t_first) if t_end > t_first else 0.0
    gpu, host = load.peak_memory_gib(device)
    peak = host if gpu is None else gpu
    stats = {"prompt_tokens": n_prompt, "generated_tokens": n_new, "ttft_s": round(ttft, 4),
             "prefill_tok_s": round(n_prompt / ttft, 1), "decode_tok_s": round(decode_tps, 1),
             "peak_memory_gib": round(peak, 2), "batch": len(ids)}
    texts = [tok.decode([i for i in o if i not in tok.eos_ids]) for o in out]
    if args.json:
        for i, o, text in zip(ids, out, texts):
            print(json.dumps({"prompt_tokens": i, "tokens": o, "text": text, "stats": stats}, ensure_ascii=False))
    elif not stream:
        print("\n\n".join(texts))
    print(f"[{n_prompt} prompt tokens, {n_new} generated, batch {len(ids)} | TTFT {ttft * 1000:.0f} ms | prefill "
          f"{stats['prefill_tok_s']:.0f} tok/s | decode {decode_tps:.1f} tok/s | peak memory {peak:.2f} GiB]",
          file=sys.stderr)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help of generate.py, chat.py and bench.py: the description's lines as written, and each flag's default
    where it has one (not "None" where the help says what happens without it)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_model_args(p):
    """The flags generate.py and chat.py share: checkpoint, sampling, seed, device, dtype, graphs."""
    p.add_argument("-c", "--checkpoint", default="RecursiveSI/flint",
                   help="checkpoint directory, .gguf file, HF repo id, or 'tiny' (random weights, offline)")
    p.add_argument("-t", "--temperature", type=float, help="0 = greedy (default: generation_config.json, or 1.0)")
    p.add_argument("--top-k", type=int, help="0 = off (default: generation_config.json, or 20)")
    p.add_argument("--top-p", type=float, help="1.0 = off (default: generation_config.json, or 0.95)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling's random numbers")
    p.add_argument("--device", help="cuda when available, else cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-graph", action="store_true", help="decode eagerly instead of replaying a CUDA graph")


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("-p", "--prompt", default="Hello, my name is", help="prompt text, or - to read stdin")
    p.add_argument("--prompt-file", help="file with one prompt per line (decoded together as a batch); - = stdin")
    p.add_argument("-n", "--max-new-tokens", type=int, default=200, help="tokens to generate per prompt")
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default: the model's context)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) instead of text")
    return p


if __name__ == "__main__":
    args = parser().parse_args()
    try:
        main(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
