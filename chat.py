"""Chat with Flint: python chat.py --checkpoint RecursiveSI/flint

The conversation is rendered with the checkpoint's own chat template, and each turn prefills only its new tokens
on top of the KV cache kept from the turns before. Type /help for the commands.
"""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":                       # before torch starts any thread, which inherits it: see ctrl_c()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

import torch  # noqa: E402

import flint  # noqa: E402
import load  # noqa: E402
from generate import HelpFormatter, add_model_args, decode, load_model, prefill, sampling_expects  # noqa: E402

HELP = """commands:
  /help                      this help
  /clear                     start a new conversation (keeps the system prompt)
  /system [TEXT]             show or set the system prompt
  /set [NAME VALUE]          show the settings, or set temperature, top_p, top_k or max_tokens
  /regen                     answer the last message again
  /save FILE, /load FILE     write or read the conversation as JSON
  /exit                      quit (or Ctrl-D)
  \"\"\" starts and ends a multi-line message; Ctrl-C stops a reply"""
THINK, END_THINK = "<think>", "</think>"


class ContextFull(Exception):
    pass


class Chat:
    """A conversation, the KV cache that holds it, and the decode step that extends it."""

    def __init__(self, ckpt, max_seq_len, settings, graph=True, system=None):
        self.model, self.tok, self.template = ckpt.model, ckpt.tokenizer, ckpt.chat_template
        self.settings, self.graph, self.system = settings, graph, system
        self.cache = flint.KVCache(self.model.cfg, 1, max_seq_len, self.model.dtype, self.model.device)
        self.sliding = [i for i in range(self.model.cfg.num_hidden_layers) if self.model.cfg.is_sliding(i)]
        self.messages = []        # user and assistant turns (the system prompt is kept apart)
        self.cached = []          # token ids whose keys and values are in the cache, at positions 0, 1, ...
        self.snapshot = None      # (ids, sliding rings, logits) right after the last prefill: /regen and rewinds
        self.new_step()

    def new_step(self):
        """(Re)build the decode step, whose CUDA graph holds the sampling settings (the cache is kept)."""
        s = self.settings
        self.step = flint.DecodeStep(self.model, self.cache, s["temperature"], s["top_k"], s["top_p"],
                                     self.tok.n_vocab, graph=self.graph and self.model.device.type == "cuda")

    def clear(self):
        self.messages, self.cached, self.snapshot = [], [], None

    def render(self, messages):
        system = [{"role": "system", "content": self.system}] if self.system else []
        return load.render_chat(self.template, system + messages, add_generation_prompt=True, tokenizer=self.tok)

    def start(self, ids):
        """Bring the cache to hold the prompt ids and return the logits [1, V] after its last token, prefilling
        only what the cache does not hold yet (self.prefilled says how many)."""
        if len(ids) >= self.cache.max_seq_len:
            raise ContextFull(f"the conversation is {len(ids)} tokens and the context holds {self.cache.max_seq_len}")
        snap = self.snapshot
        if snap is not None and snap[0] == ids:                      # /regen: the same prompt as last time
            self.restore(snap)
            self.prefilled = 0
            return snap[2].clone()
        same = 0
        for a, b in zip(self.cached, ids[:-1]):                      # at least one token to prefill, for logits
            if a != b:
                break
            same += 1
        if same < len(self.cached):
            # The template rendered the past differently (it may drop old reasoning). Full layers can rewind
            # (they hold every position), sliding layers cannot: their rings hold only the newest 513 keys, and a
            # token at position p needs those of p - 512 .. p - 1. The rings kept at the last prefill's end n
            # serve a restart at n - 1 or n (the reply, or the <think> a generation prompt opened, was dropped);
            # otherwise start afresh.
            n = len(snap[0]) if snap is not None else 0
            keep = snap is not None and same >= n - 1 and snap[0][:same] == ids[:min(same, n)]
            if keep:
                self.restore(snap)
            same = min(same, n) if keep else 0
        self.cached, self.snapshot = [], None                        # until the prefill has run
        logits = prefill(self.model, self.cache, ids[same:], start=same)
        self.cached, self.prefilled = list(ids), len(ids) - same
        rings = [(self.cache.k[i].clone(), self.cache.v[i].clone()) for i in self.sliding]
        self.snapshot = (list(ids), rings, logits.clone())
        return logits

    def restore(self, snap):
        for i, (k, v) in zip(self.sliding, snap[1]):
            self.cache.k[i].copy_(k)
            self.cache.v[i].copy_(v)
        self.cached = list(snap[0])

    def reply(self, out):
        """Answer the conversation: stream the reply to out (a Printer) and add it to the messages; returns
        stats. Ctrl-C stops the reply and keeps what was written."""
        t0 = time.perf_counter()
        prompt = self.render(self.messages)
        ids = self.tok.encode(prompt)
        logits = self.start(ids)
        tok = self.step.sample(logits)                               # [1]
        at = len(ids)                                                # position of the token to feed next
        pos = torch.tensor([at], device=self.model.device)
        decoder, new, stop, t_first = load.StreamDecoder(self.tok), [], None, None
        thinking = _opens_thinking(prompt)
        out.begin(thinking)
        # Each step is queued before the host reads the token before it (generate.decode), so a reply that stops on
        # EOS or Ctrl-C has fed its last token too: that wrote the keys of position `at`, past self.cached, which
        # the next turn's prefill writes again before any token reads them (or Chat.start restores the rings)
        n = min(self.settings["max_tokens"], self.cache.max_seq_len - at)    # (both 1 or more: start)
        for host in decode(self.step, tok, pos, n):
            t = int(host[0])
            t_first = t_first or time.perf_counter()
            new.append(t)
            if t in self.tok.eos_ids:
                break
            out.write(decoder.push(t))
            if len(new) >= self.settings["max_tokens"]:
                stop = "max_tokens reached"
                break
            if at + 1 >= self.cache.max_seq_len:
                stop = "the context is full: /clear starts a new conversation"
                break
            if ctrl_c():
                stop = "interrupted"
                break
            self.cached.append(t)                                    # its keys and values are (being) cached
            at += 1
        t_end = time.perf_counter()
        out.write(decoder.flush())
        out.end()
        text = self.tok.decode([t for t in new if t not in self.tok.eos_ids])
        self.messages.append(assistant_message(text, thinking))
        t_first = t_first or t_end
        return dict(prompt=len(ids), prefilled=self.prefilled, tokens=len(new), ttft=t_first - t0,
                    tok_s=(len(new) - 1) / (t_end - t_first) if len(new) > 1 and t_end > t_first else 0.0, stop=stop)


# Ctrl-C. Run as a program, chat.py holds SIGINT blocked in every thread (torch's threads inherit that from the
# main thread), so the terminal's Ctrl-C waits until the main thread asks: input() takes it as KeyboardInterrupt,
# and a reply polls for it between tokens (stopping cleanly, the cache consistent). Unblocked, a signal could land
# on a torch worker thread while the main thread sits in input() and go unnoticed.


def ctrl_c():
    """Whether Ctrl-C was pressed (and consume it)."""
    if signal.SIGINT in signal.sigpending():
        signal.sigwait({signal.SIGINT})
        return True
    return False


def ask(prompt):
    """input(), where Ctrl-C raises KeyboardInterrupt."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        return input(prompt)
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _opens_thinking(prompt):
    """Whether the rendered prompt leaves a <think> block open (a template that starts the reasoning itself)."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def assistant_message(text, thinking):
    """The reply as a message: the reasoning (<think> ... </think>) goes to reasoning_content, for the template to
    keep or drop in later turns."""
    text = THINK + text if thinking else text
    if text.lstrip().startswith(THINK):
        reasoning, _, content = text.lstrip()[len(THINK):].partition(END_THINK)
        return {"role": "assistant", "content": content.strip(), "reasoning_content": reasoning.strip()}
    return {"role": "assistant", "content": text.strip()}


class Printer:
    """Streams a reply: reasoning (<think> ... </think>) dimmed, or hidden behind a 'thinking...' note."""

    def __init__(self, stream, hide_thinking, color):
        self.stream, self.hide, self.color = stream, hide_thinking, color
        self.thinking, self.pending = False, ""

    def begin(self, thinking):
        self.pending = ""
        self._switch(thinking)

    def write(self, text):
        self.pending += text
        while True:
            tag = END_THINK if self.thinking else THINK
            i = self.pending.find(tag)
            if i < 0:
                break
            self._emit(self.pending[:i])
            self.pending = self.pending[i + len(tag):]
            self._switch(not self.thinking)
        # hold back what may be the start of a tag split over tokens
        hold = next((n for n in range(min(len(tag) - 1, len(self.pending)), 0, -1)
                     if tag.startswith(self.pending[-n:])), 0)
        self._emit(self.pending[:len(self.pending) - hold])
        self.pending = self.pending[len(self.pending) - hold:]

    def end(self):
        self._emit(self.pending)
        self.pending = ""
        self._switch(False)
        self.stream.write("\n")
        self.stream.flush()

    def _emit(self, text):
        if text and not (self.thinking and self.hide):
            self.stream.write(text.lstrip("\n") if self._fresh else text)
            self._fresh = self._fresh and not text.strip("\n")
            self.stream.flush()

    def _switch(self, thinking):
        if thinking and not self.thinking:
            self.stream.write(dim("thinking...", self.color) if self.hide else ("\x1b[2m" if self.color else ""))
        elif self.thinking and not thinking:
            self.stream.write(("\r\x1b[K" if self.color else "\n") if self.hide else
                              ("\x1b[0m\n" if self.color else "\n"))
        self.thinking, self._fresh = thinking, True
        self.stream.flush()


def dim(text, color):
    return f"\x1b[2m{text}\x1b[0m" if color else text


# -----------------------------------------------------------------------------
# The terminal: input, commands, the loop


def read_message(prompt="> "):
    """One message: a line, or the lines between two \"\"\" lines. None at end of input (Ctrl-D)."""
    try:
        line = ask(prompt)
    except EOFError:
        return None
    if not line.strip().startswith('"""'):
        return line
    first = line.strip()[3:]
    if first.endswith('"""'):                                        # \"\"\"one line\"\"\"
        return first[:-3]
    lines = [first] if first else []
    while True:
        try:
            line = ask("... ")
        except EOFError:
            return "\n".join(lines)
        if line.rstrip().endswith('"""'):
            lines.append(line.rstrip()[:-3])
            return "\n".join(lines).rstrip("\n")
        lines.append(line)


SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int}


def set_setting(chat, name, value):
    """/set NAME VALUE, checked; the sampling ones rebuild the decode step."""
    if name not in SETTINGS:
        raise ValueError(f"/set: unknown setting {name!r}; one of {', '.join(SETTINGS)}")
    try:
        v = SETTINGS[name](value)
    except ValueError:
        raise ValueError(f"/set {name}: expected a{'n integer' if SETTINGS[name] is int else ' number'}, "
                         f"got {value!r}") from None
    expected = ("1 or more" if v < 1 else None) if name == "max_tokens" else sampling_expects(name, v)
    if expected:
        raise ValueError(f"/set {name}: expected {expected}, got {value}")
    chat.settings[name] = v
    if name != "max_tokens":
        chat.new_step()


def save_conversation(chat, path):
    data = {"system": chat.system, "messages": chat.messages}
    Path(path).expanduser().write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def load_conversation(chat, path):
    """A file /save wrote, or a plain list of messages (a leading system message becomes the system prompt)."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"/load: no such file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"/load: {path} is not a JSON conversation ({e})") from None
    system, messages = (data.get("system"), data.get("messages")) if isinstance(data, dict) else (None, data)
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system, messages = messages[0].get("content"), messages[1:]
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "tool") and isinstance(m.get("content"), str)
            for m in messages) or not (system is None or isinstance(system, str)):
        raise ValueError(f"/load: {path} is not a conversation: expected {{\"system\": text or null, \"messages\": "
                         f"[{{\"role\": \"user\" | \"assistant\", \"content\": text}}, ...]}}, as /save writes")
    chat.clear()
    chat.system, chat.messages = system, messages


def command(chat, line):
    """Run a /command; False to quit."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name in ("/help", "/?"):
        print(HELP)
    elif name == "/clear":
        chat.clear()
        print("(new conversation)")
    elif name == "/system":
        if arg:
            chat.system = arg
            print("(system prompt set)")
        else:
            print(f"system prompt: {chat.system!r}" if chat.system else "(no system prompt; /system TEXT sets one)")
    elif name == "/set":
        if arg:
            set_setting(chat, *(arg.split(None, 1) + [""])[:2])
        print("  ".join(f"{k} {v}" for k, v in chat.settings.items()))
    elif name == "/regen":
        if not chat.messages or chat.messages[-1]["role"] != "assistant":
            raise ValueError("/regen: there is no reply to answer again yet")
        chat.messages.pop()
        return "reply"
    elif name == "/save":
        if not arg:
            raise ValueError("/save: give a file name, e.g. /save chat.json")
        save_conversation(chat, arg)
        print(f"(saved {len(chat.messages)} messages to {arg})")
    elif name == "/load":
        if not arg:
            raise ValueError("/load: give a file name, e.g. /load chat.json")
        load_conversation(chat, arg)
        print(f"(loaded {len(chat.messages)} messages from {arg}; the next message continues that conversation)")
    else:
        raise ValueError(f"unknown command {name}; /help lists the commands")
    return True


def answer(chat, out, color):
    """One reply, with the stats line after it; errors a user can cause are printed and the chat goes on."""
    try:
        s = chat.reply(out)
    except ContextFull as e:
        chat.messages.pop()
        print(f"error: {e}: this message was not sent. /clear starts a new conversation (or restart with a "
              f"larger --max-seq-len)", file=sys.stderr)
        return
    except load.ChatTemplateError as e:
        chat.messages.pop()
        print(f"error: {e}; this message was not sent", file=sys.stderr)
        return
    except KeyboardInterrupt:                                        # (chat.py takes Ctrl-C between tokens)
        chat.messages.pop()
        print("\n(interrupted; this message was not sent)", file=sys.stderr)
        return
    note = f" | {s['stop']}" if s["stop"] else ""
    if s["stop"] == "interrupted":                                   # the terminal may drop output at Ctrl-C
        print(file=sys.stderr)
    print(dim(f"[{s['tokens']} tokens | prompt {s['prompt']} ({s['prefilled']} new) | TTFT {s['ttft'] * 1000:.0f} "
              f"ms | decode {s['tok_s']:.1f} tok/s{note}]", color), file=sys.stderr)


def turn(chat, out, color):
    """Read one message or command and act on it; False to quit."""
    line = read_message()
    if line is None:                                                 # Ctrl-D
        print(file=sys.stderr)
        return False
    if not line.strip():
        return True
    if line.startswith("/") and not line.startswith("//"):          # // sends a message that starts with /
        try:
            action = command(chat, line)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return True
        if action == "reply":
            answer(chat, out, color)
        return action is not False
    chat.messages.append({"role": "user", "content": line[1:] if line.startswith("//") else line})
    answer(chat, out, color)
    return True


def main(args):
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: expected 1 or more")
    ckpt, sampling = load_model(args)
    if ckpt.chat_template is None:
        raise ValueError(f"checkpoint {ckpt.name} has no chat template (chat_template.jinja, tokenizer_config.json "
                         f"or the GGUF's tokenizer.chat_template); use generate.py for raw prompts")
    cfg = ckpt.model.cfg
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else cfg.max_position_embeddings
    if not 1 < max_seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {max_seq_len}: expected 2 to {cfg.max_position_embeddings} (the model's "
                         f"context)")
    settings = {k: sampling[k] for k in ("temperature", "top_p", "top_k")} | {"max_tokens": args.max_tokens}
    try:
        chat = Chat(ckpt, max_seq_len, settings, graph=not args.no_graph, system=args.system)
    except torch.OutOfMemoryError:
        raise ValueError(f"the KV cache for a {max_seq_len}-token context does not fit in {ckpt.model.device} memory "
                         f"next to the model; lower --max-seq-len") from None
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    out = Printer(sys.stdout, args.hide_thinking, color)
    history = Path(args.history).expanduser() if args.history else None
    try:
        import readline                                              # line editing and history for input()
        if history is not None and history.exists():
            readline.read_history_file(history)
    except (ImportError, OSError) as e:
        print(f"(no input history: {e})", file=sys.stderr)
    print(f"chatting with {ckpt.name} (context {max_seq_len} tokens, KV cache {chat.cache.nbytes / 2**30:.2f} GiB); "
          f"/help for commands, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            if not turn(chat, out, color):
                break
        except KeyboardInterrupt:                                    # at the prompt, or while printing
            print("\n(Ctrl-D or /exit quits)", file=sys.stderr)
    if history is not None:
        try:
            import readline
            readline.write_history_file(history)
        except (ImportError, OSError) as e:
            print(f"(input history not saved to {history}: {e})", file=sys.stderr)


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("-n", "--max-tokens", type=int, default=4096, help="longest reply, in tokens")
    p.add_argument("--hide-thinking", action="store_true", help="do not show the <think> reasoning")
    p.add_argument("--max-seq-len", type=int, help="context length of the conversation (default: the model's)")
    p.add_argument("--history", default="~/.flint_chat_history", help="input history file ('' = none)")
    return p


if __name__ == "__main__":
    args = parser().parse_args()
    try:
        main(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
