"""The actor's tokenizer behind two small protocols.

``Tokenizer`` counts text (the ledger stores per-step counts with it: estimates for planning).
``ChatTokenizer`` is what the actor receives: the model's chat template applied to messages, the
text encoded to ids (special tokens of the template parsed as such), and ids decoded back. The
compiler budgets the exact ids of the assembled chat (``palimpsest.platform.prompt.chat``).

Two implementations: the actor's own (an HF ``tokenizer.json`` plus the chat template saved beside it,
the same files vLLM loads; rendered with jinja2 as transformers does), or a dependency-free
approximation with a ChatML template when no model is configured.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from palimpsest.platform.types import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def count_batch(self, texts: Sequence[str]) -> list[int]: ...


@runtime_checkable
class ChatTokenizer(Protocol):
    name: str

    def template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


#: ChatML, the template of SmolLM2 (and of Qwen-style models): used where a tokenizer carries none.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")


def defuse(text: str, specials: Sequence[str]) -> str:
    """Text containing a special token's string (a tool output saying ``<|im_start|>system``) would be
    encoded as that special token and could forge a turn of another role; a backslash after its first
    character keeps it readable and makes it plain text."""
    for sp in specials:
        if sp in text:
            text = text.replace(sp, sp[0] + "\\" + sp[1:])
    return text


@lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def render_template(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                    specials: Sequence[str], **extra: Any) -> str:
    """Apply a chat template (HF's jinja dialect) to messages whose contents are defused first. Tool
    declarations ride on the first message (``tools``) and reach the template as its ``tools`` variable."""
    messages, tools = for_template(messages, source)
    safe = [{**m, "content": defuse(m["content"], specials)} if isinstance(m.get("content"), str) else dict(m)
            for m in messages]
    if tools is not None:
        extra = {**extra, "tools": tools}
    return _compile_template(source).render(messages=safe, add_generation_prompt=add_generation_prompt, **extra)


def supports_tools(source: str) -> bool:
    """Whether a chat template renders tool declarations and assistant tool calls itself."""
    return "tools" in source and "tool_calls" in source


def for_template(messages: Sequence[Mapping[str, Any]], source: str) -> tuple[list[dict], list | None]:
    """``messages`` as the template can take them, and the tool declarations to pass it (None: none).

    A template with tool support gets the declarations and the structured tool calls as they are. Any
    other template would drop them without a word, so they are written into the text instead: the
    declarations at the end of the system message, each call as a ``name(arguments)`` line of the
    assistant's content. Nothing the agent sent is missing from the prompt either way."""
    msgs = [dict(m) for m in messages]
    tools = msgs[0].pop("tools", None) if msgs else None
    if supports_tools(source):
        return msgs, tools
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
        first = msgs[0]
        first["content"] = ((first.get("content") or "") + "\n\n## Tools\n" + listing).lstrip("\n")
    for m in msgs:
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            lines = "\n".join(f"{(c.get('function') or {}).get('name', 'tool')}"
                              f"({(c.get('function') or {}).get('arguments', '')})"
                              for c in calls)
            m["content"] = "\n".join(x for x in (m.get("content") or "", lines) if x)
    return msgs, None


# Letter runs are cut every 6 characters, digits every 3, every other visible character is a token:
# close to what byte-level BPEs do on English prose and code, with no vocabulary to load.
_APPROX = re.compile(r"[A-Za-z]{1,6}|\d{1,3}|[^\sA-Za-z\d]|\n")


# The approximation's pieces cover every character (spaces ride with the piece after them), so its ids
# decode back to the text; the template's special strings are one piece each.
_PIECES = re.compile(r"<\|im_(?:start|end)\|>| ?[A-Za-z]{1,6}| ?\d{1,3}|\n| +|[^\sA-Za-z\d]|\s")


class ApproxTokenizer:
    """A deterministic, dependency-free approximation of a BPE tokenizer, with a ChatML template.

    Its ids index a process-wide table of the pieces seen so far, so they decode back to the text."""

    name = key = "approx-v1"
    _vocab: dict[str, int] = {}
    _pieces: list[str] = []
    _lock = threading.Lock()

    def count(self, text: str) -> int:
        return len(_APPROX.findall(text)) if text else 0

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        return [self.count(t) for t in texts]

    def template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return render_template(CHATML, messages, add_generation_prompt, CHATML_SPECIALS)

    def encode(self, text: str) -> list[int]:
        vocab, pieces = ApproxTokenizer._vocab, ApproxTokenizer._pieces
        out = []
        for p in _PIECES.findall(text):
            i = vocab.get(p)
            if i is None:
                with ApproxTokenizer._lock:
                    i = vocab.get(p)
                    if i is None:
                        i = vocab[p] = len(pieces)
                        pieces.append(p)
            out.append(i)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(ApproxTokenizer._pieces[i] for i in ids)


class HFTokenizer:
    """An HF ``tokenizers`` tokenizer loaded from a local ``tokenizer.json`` (or a folder holding one), with
    the chat template saved beside it (``chat_template.jinja`` or ``tokenizer_config.json``; ChatML if none)."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        try:
            from tokenizers import Tokenizer as _Tok  # light: a Rust extension, no torch
        except ImportError as e:  # pragma: no cover - tokenizers ships with the full install
            raise ConfigError("the 'tokenizers' package is needed for an HF tokenizer") from e
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"tokenizer file not found: {p}")
        self._tok = _Tok.from_file(str(p))
        self.name = f"hf:{p.parent.name}"
        self.spec = str(path)  # what a ledger records to reopen it with the same tokenizer
        self.chat_template, self._extra = _chat_template(p.parent)
        if chat_template is not None:  # a template named in the config (one with tool support, say)
            self.chat_template = chat_template
        spec = json.loads(p.read_text())
        added = spec.get("added_tokens", [])
        specials = {a["content"] for a in added if a.get("special") and len(a.get("content", "")) > 1}
        self.specials = tuple(sorted(specials, key=len, reverse=True))
        # The tokenizer cuts a text at its added tokens first and encodes the pieces between them on their own,
        # so a chat (whose messages the template delimits with special tokens) can be encoded piece by piece,
        # each piece once: a turn re-encodes only the messages it has not seen. Exact only when the added
        # tokens match verbatim (no strip, word or normalisation rules); otherwise every text is encoded whole.
        plain = added and all(not (a.get("lstrip") or a.get("rstrip") or a.get("single_word") or a.get("normalized"))
                              for a in added)
        self._added = {a["content"]: a["id"] for a in added} if plain else {}
        self._split = (re.compile("(" + "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
                                  + ")")
                       if self._added else None)
        self._pieces: dict[str, tuple[list[int], str | None]] = {}
        self._cached_chars = 0
        self._lock = threading.Lock()  # turns encode from several worker threads
        self.key = str(p.resolve())  # what caches are keyed by (two folders may share a name)
        if chat_template is not None:
            self.key += "#" + hashlib.sha256(chat_template.encode()).hexdigest()[:16]

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._split is None:
            return self._tok.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            tid = self._added.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            out.extend(self._piece(piece)[0])
        return out

    def _piece(self, piece: str) -> tuple[list[int], str | None]:
        hit = self._pieces.get(piece)
        if hit is None:
            hit = (self._tok.encode(piece, add_special_tokens=False).ids, None)
            with self._lock:
                while self._pieces and self._cached_chars + len(piece) > _PIECE_CACHE_CHARS:
                    old = next(iter(self._pieces))
                    self._cached_chars -= len(old)
                    del self._pieces[old]
                if len(piece) <= _PIECE_CACHE_CHARS and piece not in self._pieces:
                    self._pieces[piece] = hit
                    self._cached_chars += len(piece)
        return hit

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_encoded(self, text: str) -> str:
        """``decode(encode(text))`` (what the actor receives of ``text``), piece by piece from the cache: the
        pieces between added tokens are whole strings, so their decodings concatenate."""
        if self._split is None:
            return self.decode(self.encode(text))
        out = []
        for piece in self._split.split(text):
            if not piece:
                continue
            if piece in self._added:
                out.append(piece)
                continue
            ids, decoded = self._piece(piece)
            if decoded is None:
                decoded = self.decode(ids)
                with self._lock:
                    if piece in self._pieces:
                        self._pieces[piece] = (ids, decoded)
            out.append(decoded)
        return "".join(out)

    def template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return render_template(self.chat_template, messages, add_generation_prompt, self.specials, **self._extra)


def _chat_template(folder: Path) -> tuple[str, dict[str, Any]]:
    """The folder's chat template and the special-token strings a template may name (bos_token, eos_token)."""
    extra: dict[str, Any] = {}
    source = None
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        for k in ("bos_token", "eos_token"):
            v = cfg.get(k)
            extra[k] = v.get("content", "") if isinstance(v, dict) else (v or "")
        source = cfg.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        source = jinja.read_text()
    return source or CHATML, extra


class TransformersChat:
    """A ``transformers`` tokenizer object (already loaded, e.g. one built in memory) as a ChatTokenizer:
    its own chat template, contents defused against its own special tokens."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.name = f"hf:{Path(str(getattr(tok, 'name_or_path', '') or 'memory')).name}"
        names = set(getattr(tok, "all_special_tokens", []) or [])
        names |= {t.content for t in (getattr(tok, "added_tokens_decoder", {}) or {}).values()
                  if getattr(t, "special", True)}
        self.specials = tuple(sorted((n for n in names if isinstance(n, str) and len(n) > 1), key=len, reverse=True))

    def template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        source = getattr(self._tok, "chat_template", None)
        if source is None:
            return render_template(CHATML, messages, add_generation_prompt, self.specials)
        messages, tools = for_template(messages, source)
        safe = [{**m, "content": defuse(m["content"], self.specials)} if isinstance(m.get("content"), str) else m
                for m in messages]
        return self._tok.apply_chat_template(safe, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **({"tools": tools} if tools is not None else {}))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        return [self.count(t) for t in texts]


def as_chat_tokenizer(tok: Any) -> ChatTokenizer:
    """``tok`` itself when it is a ChatTokenizer, else a loaded ``transformers`` tokenizer wrapped as one."""
    if isinstance(tok, ChatTokenizer):
        return tok
    if hasattr(tok, "apply_chat_template"):
        return TransformersChat(tok)
    raise ConfigError(f"{type(tok).__name__} is not a chat tokenizer")


_PIECE_CACHE_CHARS = 64 * 1024 * 1024  # the encoded pieces kept per tokenizer (characters of text)


@lru_cache(maxsize=8)
def _hf(path: str, chat_template: str | None = None) -> HFTokenizer:
    return HFTokenizer(path, chat_template)


def get_tokenizer(spec: str | None = None, chat_template: str | None = None) -> Tokenizer:
    """``None`` or ``"approx"`` gives the approximation; anything else is a path to an HF tokenizer, whose
    own chat template ``chat_template`` (the template's source) replaces when given."""
    if spec in (None, "", "approx", ApproxTokenizer.name):
        return ApproxTokenizer()
    return _hf(str(spec), chat_template)
