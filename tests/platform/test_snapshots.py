"""Incremental snapshots: a cached snapshot is the ledger's own, whoever wrote to the session."""

import dataclasses

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.prompt.abstraction import RuleSummarizer
from palimpsest.platform.types import Fold
from tests.helpers import same_snapshot, step


def _steps(start: int, n: int):
    return [step(t, f"cat src/mod_{t}.py", f"def f_{t}(): return {t}  # TOKEN{t}") for t in range(start, start + n)]


class _Louder(RuleSummarizer):
    """A second producer: its summaries replace the rule ones (latest producer wins)."""
    name, version = "louder", "1"

    def summarize(self, step):
        s = super().summarize(step)
        return dataclasses.replace(s, brief=s.brief.upper())


def test_the_cached_snapshot_equals_a_whole_read_after_every_kind_of_write(ledger):
    rt = Runtime(ledger)
    ledger.create_session("s", "Keep the build green.")
    ledger.append_many("s", _steps(0, 5))
    first = rt.snapshot("s")  # read whole, cached
    assert rt.snapshots.stats["full_reads"] == 1
    rt.enrich("s")  # summaries and keys of cached steps
    ledger.append_many("s", _steps(5, 3))  # new steps, not enriched yet
    same_snapshot(rt.snapshot("s"), ledger.snapshot("s", key_model=rt.embedder.name))
    rt.enrich("s")
    ledger.add_fold("s", "rolling", Fold(upto=4, text="so far: five files read", tokens=7, producer="rule"))
    rt.turn("s", "pace", Budget(4000))  # an audited turn: the policy's last context size
    loud = Runtime(ledger, summarizer=_Louder())
    loud.enrich("s")  # a newer producer's summaries of steps the cache already holds
    cached = rt.snapshot("s")
    same_snapshot(cached, ledger.snapshot("s", key_model=rt.embedder.name))
    assert rt.snapshots.stats["full_reads"] == 1 and rt.snapshots.stats["refreshes"] >= 2
    assert first.t == 5 and first.tokens.shape == (5, 4)  # an earlier snapshot is unchanged by later writes
    assert cached.bodies[1][0].isupper()


def test_a_second_replicas_append_invalidates_the_first_replicas_cached_snapshot(ledger_url):
    a = Runtime(Ledger(ledger_url))
    b = Runtime(Ledger(ledger_url))  # another replica: its own connection, its own cache
    try:
        a.ledger.create_session("s", "Keep the build green.")
        a.append("s", _steps(0, 1)[0])
        assert a.snapshot("s").t == 1  # cached by replica a
        assert a.snapshot("s").t == 1 and a.snapshots.stats["hits"] == 1
        b.append("s", _steps(1, 1)[0])  # replica b appends and enriches
        snap = a.snapshot("s")  # before its next turn, a sees b's step, summary and key
        assert snap.t == 2 and snap.has_key.all() and snap.bodies[1][1] is not None
        assert a.snapshots.stats["refreshes"] == 1 and a.snapshots.stats["full_reads"] == 1
        same_snapshot(snap, b.ledger.snapshot("s", key_model=a.embedder.name))
        assert "TOKEN1" in a.turn("s", "pace", Budget(4000)).prompt.text
    finally:
        a.ledger.close()
        b.ledger.close()


def test_the_cache_is_bounded_in_bytes_and_an_evicted_session_is_read_whole(ledger):
    rt = Runtime(ledger)
    for sid in ("x", "y", "z"):
        ledger.create_session(sid, "Keep the build green.")
        ledger.append_many(sid, _steps(0, 40))
        rt.snapshot(sid)
        if sid == "x":  # room for one and a half sessions of this size
            rt.snapshots.max_bytes = int(rt.snapshots.nbytes * 1.5)
        assert 0 < rt.snapshots.nbytes <= rt.snapshots.max_bytes
    assert rt.snapshots.stats["evictions"] == 2 and rt.snapshots.cached_steps() == 40
    same_snapshot(rt.snapshot("x"), ledger.snapshot("x", key_model=rt.embedder.name))


def test_turns_are_the_same_with_and_without_the_cache(ledger):
    cached, whole = Runtime(ledger), Runtime(ledger, snapshot_cache_bytes=0)
    ledger.create_session("s", "Keep the build green.")
    for t in range(12):
        cached.append("s", _steps(t, 1)[0])
        for pol in ("pace", "rolling_summary", "ace"):
            a = cached.turn("s", pol, Budget(1500), record=False)
            b = whole.turn("s", pol, Budget(1500), record=False)
            assert a.prompt.text == b.prompt.text, (t, pol)
    assert whole.snapshots.stats["full_reads"] == 36 and cached.snapshots.stats["full_reads"] == 1


def test_a_step_appended_before_its_key_keeps_the_key_matrix_aligned(ledger):
    """The serving order: the cache holds keyed steps, then a step arrives whose key is written later."""
    rt = Runtime(ledger)
    ledger.create_session("s", "Keep the build green.")
    for t in range(3):
        rt.append("s", _steps(t, 1)[0])  # enriched: keys exist
    rt.snapshot("s")
    rt.append("s", _steps(3, 1)[0], enrich=False)  # no key yet
    snap = rt.snapshot("s")
    assert snap.keys.shape[0] == snap.t == 4 and not snap.has_key[3]
    same_snapshot(snap, ledger.snapshot("s", key_model=rt.embedder.name))
    rt.turn("s", "pace", Budget(4000))
    rt.enrich("s")
    same_snapshot(rt.snapshot("s"), ledger.snapshot("s", key_model=rt.embedder.name))
