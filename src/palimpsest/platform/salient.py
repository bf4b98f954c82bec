"""The identifiers of a text: paths, URLs, dotted names, hashes, ids, numbers, in order of first occurrence.

What later actions reuse. The abstraction writer extracts them (``platform.abstraction``); a placeholder keeps
the few a step's result is most about (``render.step_messages``), so a step degraded to one line still names
them; policies match them (ACE's elasticizer, PACE+), and replay checks needs against them.
"""

from __future__ import annotations

import re

_URL = re.compile(r"https?://[^\s'\"<>)\]}`]+")
_PATH = re.compile(
    r"(?<![\w/.-])(?:\.{0,2}/)?(?:[\w.-]+/)+[\w.-]*\w"
    r"|\b[\w-]+\.(?:py|pyi|js|ts|tsx|jsx|md|rst|txt|json|ya?ml|toml|cfg|ini|c|h|cc|cpp|hpp|java|go|rs|rb|sh"
    r"|html|css|csv|sql|xml|lock|log|ipynb)\b"
)
_HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
_ID = re.compile(r"\b(?=\w*\d)(?=\w*[A-Za-z])\w{5,}\b")
_NUMBER = re.compile(r"(?<![\w.])\d{3,}(?![\w.])")
_DOTTED = re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b")
_WORD = re.compile(r"\b[A-Za-z_]\w{5,}\b")
_STRING = re.compile(r"'([^'\n]{8,100})'|\"([^\"\n]{8,100})\"")


def _is_identifier(w: str) -> bool:
    return "_" in w or re.search(r"[a-z][A-Z]", w) is not None or sum(c.isupper() for c in w) >= 2


def uniq(items, limit: int) -> list[str]:
    seen: dict[str, None] = {}
    for it in items:
        if it and it not in seen:
            seen[it] = None
            if len(seen) >= limit:
                break
    return list(seen)


def extract_salient(text: str, limit: int = 256) -> tuple[list[str], list[str], list[str], list[str]]:
    """(identifiers, paths, urls, numbers) of a text, in order of first occurrence."""
    urls = uniq(_URL.findall(text), limit)
    rest = _URL.sub(" ", text)
    paths = uniq((p for p in _PATH.findall(rest) if "/" in p or "." in p), limit)
    rest = _PATH.sub(" ", rest)
    ids: list[str] = []
    ids += _DOTTED.findall(rest)
    ids += _HASH.findall(rest)
    ids += _ID.findall(rest)
    ids += [w for w in _WORD.findall(rest) if _is_identifier(w)]
    ids += [a or b for a, b in _STRING.findall(rest)]
    numbers = uniq(_NUMBER.findall(rest), limit)
    return uniq(ids, limit), paths, urls, numbers


def ranked_ids(text: str, ids: list[str], paths: list[str], n_ids: int) -> list[str]:
    """What a text is most about: up to 3 of its paths, then up to ``n_ids`` identifiers, each by how often the
    text returns to it (ties: first occurrence first)."""
    return sorted(paths[:24], key=lambda w: -text.count(w))[:3] + sorted(ids, key=lambda w: -text.count(w))[:n_ids]


#: a placeholder's identifiers: at most this many characters of them, and this many items
PLACEHOLDER_ID_CHARS = 72
PLACEHOLDER_IDS = 4


def placeholder_ids(observation: str | None, shown: str = "") -> list[str]:
    """The identifiers a step's result introduced that its one-line placeholder keeps: the ones the result is
    most about (``ranked_ids``), then its URLs, leaving out what the line already shows (``shown``) and
    anything shorter than 4 characters, within ``PLACEHOLDER_IDS`` items and ``PLACEHOLDER_ID_CHARS``."""
    if not observation:
        return []
    ids, paths, urls, _ = extract_salient(observation, limit=64)
    out: list[str] = []
    used = 0
    for tok in uniq(ranked_ids(observation, ids, paths, 6) + urls[:1], 16):
        if len(tok) < 4 or tok in shown or len(tok) > PLACEHOLDER_ID_CHARS:
            continue
        if used + len(tok) + 2 > PLACEHOLDER_ID_CHARS or len(out) >= PLACEHOLDER_IDS:
            break
        out.append(tok)
        used += len(tok) + 2
    return out


__all__ = ["PLACEHOLDER_IDS", "PLACEHOLDER_ID_CHARS", "extract_salient", "placeholder_ids", "ranked_ids", "uniq"]
