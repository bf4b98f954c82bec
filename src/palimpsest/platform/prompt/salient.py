"""The identifiers of a text: paths, URLs, dotted names, hashes, ids, numbers, in order of first occurrence.

What later actions reuse. The abstraction writer extracts them (``platform.prompt.abstraction``); a placeholder keeps
the few a step's result is most about (``render.step_messages``), so a step degraded to one line still names
them; policies match them (ACE's elasticizer, PACE+), and replay checks needs against them.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Sequence

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


#: a range line's identifiers (``platform.prompt.render.range_message``): at most this many characters, and items
#: (a placeholder's caps: a range line stands for one step or for thousands, and is one line either way)
RANGE_ID_CHARS = 72
RANGE_IDS = 4


def capped(tokens, max_items: int, max_chars: int, shown: str = "", words: bool = False) -> list[str]:
    """``tokens`` in order, leaving out what ``shown`` already has, anything shorter than 4 characters and
    (``words``) anything with a space in it (an expression, not a name), within ``max_items`` items and
    ``max_chars`` characters (joined by ", ")."""
    out: list[str] = []
    used = 0
    for tok in tokens:
        if len(tok) < 4 or tok in shown or len(tok) > max_chars or (words and any(c.isspace() for c in tok)):
            continue
        if used + len(tok) + 2 > max_chars or len(out) >= max_items:
            break
        out.append(tok)
        used += len(tok) + 2
    return out


def step_identifiers(action: str, observation: str) -> tuple[str, ...]:
    """The identifiers a step names, from its own text (steps never change: computed once per step): paths,
    then identifiers, then URLs, of its result and then of its action. Remembered (least recently used out) by
    the texts' hashes, so the cache holds no step's text."""
    key = (hash(action), hash(observation), len(observation))
    with _STEP_IDS_LOCK:  # compiles run on several threads in serving
        got = _STEP_IDS.get(key)
        if got is not None:
            _STEP_IDS.move_to_end(key)
            return got
    ids, paths, urls, _ = extract_salient(observation, limit=64)
    a_ids, a_paths, a_urls, _ = extract_salient(action, limit=32)
    got = tuple(uniq(paths + a_paths + ids + a_ids + urls + a_urls, 96))
    with _STEP_IDS_LOCK:
        _STEP_IDS[key] = got
        if len(_STEP_IDS) > _STEP_IDS_MAX:
            _STEP_IDS.popitem(last=False)
    return got


_STEP_IDS: "OrderedDict[tuple[int, int, int], tuple[str, ...]]" = OrderedDict()
_STEP_IDS_MAX = 1 << 17
_STEP_IDS_LOCK = threading.Lock()


def range_ids(steps: Sequence, runs: Sequence[tuple[int, int]]) -> dict[int, list[str]]:
    """For each run ``(i, j)`` of hidden steps (ascending, disjoint), the identifiers its steps name, the ones
    the session may reuse first: those the run introduced (no earlier step names them) before the rest, then
    by how many steps of the run name them, then by first occurrence. Each from the steps' own text up to the
    run's end, so a run's line is the same at every later turn (a boundary's kept prefix renders byte for byte
    again and the cache holds it). One pass over ``steps[:last j + 1]``."""
    out: dict[int, list[str]] = {}
    seen: set[str] = set()
    k = 0
    for i, j in runs:
        for s in steps[k:i]:
            seen.update(step_identifiers(s.action or "", s.observation or ""))
        count: dict[str, int] = {}
        for s in steps[i: j + 1]:
            for tok in step_identifiers(s.action or "", s.observation or ""):
                count[tok] = count.get(tok, 0) + 1
        order = {tok: n for n, tok in enumerate(count)}
        out[i] = sorted(count, key=lambda t: (t in seen, -count[t], order[t]))
        seen.update(count)
        k = j + 1
    return out


def placeholder_ids(observation: str | None, shown: str = "") -> list[str]:
    """The identifiers a step's result introduced that its one-line placeholder keeps: the ones the result is
    most about (``ranked_ids``), then its URLs, leaving out what the line already shows (``shown``) and
    anything shorter than 4 characters, within ``PLACEHOLDER_IDS`` items and ``PLACEHOLDER_ID_CHARS``."""
    if not observation:
        return []
    ids, paths, urls, _ = extract_salient(observation, limit=64)
    return capped(uniq(ranked_ids(observation, ids, paths, 6) + urls[:1], 16), PLACEHOLDER_IDS,
                  PLACEHOLDER_ID_CHARS, shown)


__all__ = ["PLACEHOLDER_IDS", "PLACEHOLDER_ID_CHARS", "RANGE_IDS", "RANGE_ID_CHARS", "capped", "extract_salient",
           "placeholder_ids", "range_ids", "ranked_ids", "step_identifiers", "uniq"]
