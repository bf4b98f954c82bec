"""Compaction epochs (platform/compile/epochs.py): append-only turns between boundaries, a boundary exactly when the
high watermark is crossed, the budget on every turn, and replicas that agree byte for byte."""

import re

import numpy as np
import pytest

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.epochs import Boundary, Compaction, cached_tokens, turn_cost, with_soft
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.prompt.chat import chat_ids
from palimpsest.platform.prompt.render import step_messages
from palimpsest.platform.types import Authority, ConfigError, Resolution, Step
from tests.helpers import STEPS, TASK, per_turn, step

POLICIES = ["full", "window", "rolling_summary", "pace", "ace", "pace_plus", "observation_masking",
            {"type": "clear_tool_uses", "trigger": 600}]
BUDGET, RESERVE = 1500, 64


def _grow(runtime, sid, t):
    action, obs = STEPS[t % len(STEPS)]
    runtime.append(sid, step(t, f"{action} # {t}", f"{obs}\nrun {t}: " + "value=%d " % (t * 7) * 20))


def _session(runtime, sid="e1"):
    runtime.ledger.create_session(sid, TASK, system="You are a careful coding agent.")
    return sid


@pytest.mark.parametrize("policy", POLICIES)
def test_between_boundaries_the_ids_strictly_extend_the_previous_turns(runtime, policy):
    """Every turn that is not a boundary sends the previous turn's ids unchanged, then the new step's."""
    sid = _session(runtime)
    prev, extensions, boundaries = None, 0, 0
    for t in range(40):
        _grow(runtime, sid, t)
        turn = runtime.turn(sid, policy, Budget(BUDGET, RESERVE))
        ids = turn.prompt.ids
        if turn.compacted:
            boundaries += 1
        elif prev is not None:
            assert len(ids) > len(prev) and ids[: len(prev)] == prev, f"t={t}: the prompt was rewritten"
            assert cached_tokens(prev, ids) == (len(prev) // 16) * 16
            extensions += 1
        prev = ids
    assert extensions >= 20
    if policy != "full":  # full is unbudgeted only in replay; here it compacts like the rest
        assert boundaries >= 2


def test_a_boundary_happens_exactly_when_the_high_watermark_is_crossed(runtime):
    sid = _session(runtime)
    cfg = parse_policy_config({"type": "pace", "compaction": {"high": 0.8, "low": 0.5}})
    pol = runtime.policy(cfg)
    tok = runtime.ledger.tokenizer
    seen = 0
    for t in range(40):
        _grow(runtime, sid, t)
        prev = runtime.boundary(sid, f"{pol.config_hash}@{BUDGET}/{RESERVE}")
        snap = runtime.snapshot(sid)
        # what the append-only turn would send: the last boundary's messages plus every step since, raw
        from palimpsest.platform.compile.compiler import prefix_segments
        from palimpsest.platform.compile.epochs import empty_boundary, extend
        from palimpsest.platform.prompt.chat import message_overhead, prefix_messages

        base = prev or empty_boundary(prefix_messages(snap.session), prefix_segments(prefix_messages(snap.session)))
        msgs, _ = extend(base, snap, message_overhead(tok))
        would = len(chat_ids(tok, msgs, base.split))
        turn = runtime.turn(sid, pol, Budget(BUDGET, RESERVE))
        crossed = would + RESERVE > int(0.8 * BUDGET)
        assert turn.compacted == crossed, f"t={t}: {would} + {RESERVE} vs {int(0.8 * BUDGET)}"
        if crossed:
            seen += 1
            info = turn.plan.info["compaction"]
            assert info["before"] == would
            # compacted to the low watermark, or higher (at most halfway to the high one) to keep the recent steps
            assert info["target"] == int(0.5 * BUDGET) or (
                info["recent"]["raised"] and info["recent"]["full"] and info["target"] <= int(0.65 * BUDGET))
            assert turn.prompt.tokens + RESERVE <= info["target"]
            (row,) = [r for r in runtime.ledger.audit(sid) if r["t"] == turn.t][-1:]
            assert row["compaction"]["id"] == turn.boundary.id  # the audit names the boundary and why
            assert "> 0.8 x 1500" in row["compaction"]["trigger"]
    assert seen >= 2


def test_a_prompt_exactly_at_the_high_watermark_extends_and_one_id_over_it_compacts(runtime):
    """The size is what an append-only turn really sends (a preview at a budget nothing reaches), not a
    recomputation. Then two budgets put the high watermark exactly at that size plus the reserve (equality: the
    epoch extends, the ids unchanged) and one id below it (the size passes it by one: a boundary)."""
    sid = _session(runtime)
    for t in range(12):
        _grow(runtime, sid, t)
    cfg = {"type": "pace", "compaction": {"high": 0.5, "low": 0.3}}
    free = runtime.turn(sid, cfg, Budget(10**6, RESERVE), record=False)
    assert not free.compacted
    size = len(free.prompt.ids) + RESERVE
    at = runtime.turn(sid, cfg, Budget(2 * size, RESERVE), record=False)  # high x budget == size
    assert not at.compacted and at.prompt.ids == free.prompt.ids
    over = runtime.turn(sid, cfg, Budget(2 * size - 2, RESERVE), record=False)  # high x budget == size - 1
    assert over.compacted and len(over.prompt.ids) + RESERVE <= over.plan.info["compaction"]["target"]
    assert over.plan.info["compaction"]["before"] + RESERVE == size


@pytest.mark.parametrize("policy", POLICIES)
def test_the_budget_bound_holds_on_every_turn(runtime, policy):
    sid = _session(runtime)
    huge = "".join(f"row {i}: {i * 13}\n" for i in range(1500))  # one step far above the budget
    for t in range(30):
        if t == 17:
            runtime.append(sid, step(t, "cat dump.csv", huge))
        else:
            _grow(runtime, sid, t)
        for reserve in (0, RESERVE, 300):
            turn = runtime.turn(sid, policy, Budget(BUDGET, reserve))  # stored: later turns extend it
            assert turn.prompt.tokens == len(turn.prompt.ids)
            assert turn.prompt.tokens + reserve <= BUDGET, (t, reserve)


def test_two_replicas_build_identical_prompts_after_a_restart(tmp_path):
    """A second replica (and a restarted one) rebuilds each append-only turn from the boundary in the ledger,
    byte for byte, with no state of the first; summaries written after the boundary change nothing."""
    url = str(tmp_path / "ledger.db")
    a = Runtime(Ledger(url))
    sid = _session(a)
    cfg = {"type": "pace", "compaction": {"high": 0.85, "low": 0.55}}
    pol = a.policy(cfg)
    chain = None  # the same epochs kept in memory only (never stored): what the ledger's copy must reproduce
    for t in range(25):
        _grow(a, sid, t)
        mem = a.compile(a.snapshot(sid), pol, Budget(BUDGET, RESERVE), chain)  # on the snapshot the turn will read
        first = a.turn(sid, cfg, Budget(BUDGET, RESERVE))
        chain = mem.boundary
        assert first.prompt.ids == mem.prompt.ids, f"t={t}: the stored boundary rebuilt another prompt"
    assert a.ledger.boundaries(sid), "the session never reached a boundary"
    a.ledger.close()
    b = Runtime(Ledger(url))  # a fresh process: no cached boundary, snapshot or prompt
    c = Runtime(Ledger(url))
    again_b = b.turn(sid, cfg, Budget(BUDGET, RESERVE))
    again_c = c.turn(sid, cfg, Budget(BUDGET, RESERVE))
    assert again_b.prompt.ids == first.prompt.ids == again_c.prompt.ids
    assert again_b.prompt.text == first.prompt.text and again_b.prompt.messages == first.prompt.messages
    for t in range(25, 30):  # turns go on on either replica, and they agree on each
        _grow(b, sid, t)
        pb = b.turn(sid, cfg, Budget(BUDGET, RESERVE))
        pc = c.turn(sid, cfg, Budget(BUDGET, RESERVE), record=False)
        assert pb.prompt.ids == pc.prompt.ids and pb.prompt.prompt_hash == pc.prompt.prompt_hash


def _boundary_then_appends(runtime, sid):
    t, turn = 0, None
    while t < 40 or turn.compacted:  # end on an append-only turn after some boundaries
        _grow(runtime, sid, t)
        turn = runtime.turn(sid, "pace", Budget(BUDGET, RESERVE))
        t += 1
    return turn


def test_the_soft_slot_is_the_boundary(runtime):
    sid = _session(runtime)
    turn = _boundary_then_appends(runtime, sid)
    b = turn.boundary
    assert b is not None and 0 < b.t < turn.t
    # the memory's slot sits after the compacted history, before the steps appended since
    assert turn.prompt.soft_at == b.split
    assert list(turn.prompt.messages[: b.split]) == list(b.messages)


def test_every_step_stays_glimpseable(runtime):
    """Glimpse-able means findable: every step is on the served prompt, shown or named by its id. A step the
    compiler hides keeps a range line while the budget holds one (``compile_plan``); before that rule this
    passed or failed by the session's arithmetic (25 of 40 steps unnamed on 2026-12-04, and again when range
    lines grew their identifiers)."""
    sid = _session(runtime)
    turn = _boundary_then_appends(runtime, sid)
    # every step is on the prompt: shown (its action, unique per step here), or named by its id (a placeholder,
    # a summary's marker, an elision, a hidden range's ids), or inside the folded summary of the oldest steps
    lost = _unfindable(turn.prompt.messages, turn.prompt.text, [runtime.ledger.step_at(sid, k) for k in range(turn.t)])
    assert lost == [], f"steps neither shown nor named by id in the prompt: {lost}"


def _unfindable(messages, text: str, steps) -> list[int]:
    """The indices of ``steps`` that a prompt neither shows nor names: shown is the step whole (its messages at
    full, in order, as the prompt's own messages), named is its id (a placeholder, a summary's marker, an
    elision, a hidden range's ids), or inside the folded summary of the oldest steps."""
    ranges = [(int(a), int(b)) for a, b in re.findall(r"ids #(\d+)\.\.#(\d+)", text)]
    folded = max([int(u) + 1 for u in re.findall(r"## Summary of steps 0\.\.(\d+)", text)], default=0)
    msgs = [(m["role"], m["content"]) for m in messages]
    lost = []
    for k, s in enumerate(steps):
        whole = [(m["role"], m["content"]) for m in step_messages(s, s.id, Resolution.FULL, None)]
        shown = any(msgs[i: i + len(whole)] == whole for i in range(len(msgs) - len(whole) + 1))
        named = re.search(rf"#{s.id}(?!\d)", text) is not None or any(a <= s.id <= b for a, b in ranges)
        if not (shown or named or k < folded):
            lost.append(k)
    return lost


def test_a_step_is_shown_only_by_its_own_messages():
    """Step 1's action ``X # 1`` is a substring of step 13's ``X # 13``: a prompt showing step 13 alone does
    not show step 1."""
    steps = [Step(id=100 + t, session_id="s", t=t, kind="bash", thought="", action=f"X # {t}", observation=f"out {t}",
                  authority=Authority.TOOL, tool="X", sha256="", tokens={}, created=0.0) for t in range(14)]
    messages = [m for s in steps[2:] for m in step_messages(s, s.id, Resolution.FULL, None)]
    text = "\n".join(m["content"] for m in messages)
    assert "X # 1" in text
    assert _unfindable(messages, text, steps) == [0, 1]
    assert _unfindable(messages + step_messages(steps[1], 101, Resolution.FULL, None), text, steps) == [0]


def test_per_turn_mode_replans_and_a_bad_compaction_config_is_refused(runtime):
    sid = _session(runtime)
    for t in range(12):
        _grow(runtime, sid, t)
    turn = runtime.turn(sid, {"type": "pace", "compaction": {"mode": "per_turn"}}, Budget(BUDGET, RESERVE))
    assert turn.boundary is None and not turn.compacted
    with pytest.raises(ConfigError, match="low"):
        parse_policy_config({"type": "pace", "compaction": {"high": 0.5, "low": 0.7}})
    with pytest.raises(ConfigError, match="compaction"):
        parse_policy_config({"type": "pace", "compaction": {"high": 1.5}})
    assert Compaction().epochs and not Compaction(mode="per_turn").epochs


def test_a_boundary_round_trips_through_its_ledger_form(runtime):
    sid = _session(runtime)
    for t in range(30):
        _grow(runtime, sid, t)
        turn = runtime.turn(sid, "ace", Budget(BUDGET, RESERVE))
    b = turn.boundary
    back = Boundary.decode(b.encode(), b.id)
    assert back.messages == b.messages and back.t == b.t and back.digest == b.digest
    assert np.array_equal(back.resolution, b.resolution) and np.array_equal(back.score, b.score)
    assert [s.messages for s in back.segments] == [s.messages for s in b.segments]


def test_turn_cost_counts_whole_blocks_and_never_the_last_id():
    prev = list(range(100))
    assert cached_tokens(prev, prev + [7, 8]) == 96  # 100 common ids: six whole blocks
    assert cached_tokens(prev, prev) == 96  # identical: the last id is computed again
    assert cached_tokens(prev, [5] + prev) == 0  # a change at the start loses everything
    assert cached_tokens(None, prev) == 0
    cost = turn_cost(list(range(64)), list(range(64)) + [1] * 36, 0.1)
    assert cost["cached"] == 64 and cost["uncached"] == 36 and cost["billed"] == pytest.approx(36 + 6.4)
    assert cost["prefix_reuse"] == pytest.approx(0.64)
    # a memory turn's soft positions are paid uncached, in every field (the served record's cost)
    soft = with_soft(cost, 100, 28)
    assert soft["cached"] == 64 and soft["uncached"] == 36 + 28 and soft["billed"] == pytest.approx(36 + 28 + 6.4)
    assert soft["prefix_reuse"] == pytest.approx(64 / 128) and with_soft(cost, 100, 0) == cost


def test_a_compaction_keeps_the_oldest_region_so_the_cache_holds_it(runtime):
    """With `keep`, a boundary renders the oldest steps as the previous boundary did: its ids share a longer
    prefix with the last turn than a rebuild of every step (keep 0), and the audit says which steps."""
    cached = {}
    for keep in (0.5, 0.0):
        sid = _session(runtime, f"k{keep}")
        cfg = {"type": "pace", "compaction": {"keep": keep}}
        prev, hits, kept = None, [], 0
        for t in range(60):
            _grow(runtime, sid, t)
            turn = runtime.turn(sid, cfg, Budget(BUDGET, RESERVE))
            if turn.compacted and turn.plan.info["compaction"]["previous_t"] > 0:
                hits.append(cached_tokens(prev, turn.prompt.ids))
                info = turn.plan.info.get("kept")
                if info and not info.get("released"):
                    kept += 1
                    n = info["steps"]
                    assert all(e.reason.startswith("kept as the compaction boundary") for e in turn.plan.entries()[:n])
            prev = turn.prompt.ids
        assert len(hits) >= 3
        cached[keep] = (float(np.mean(hits)), kept)
    assert cached[0.5][1] >= 1 and cached[0.0][1] == 0
    assert cached[0.5][0] > cached[0.0][0]


def test_a_preview_stores_no_boundary_and_a_historical_view_uses_the_boundary_of_its_time(runtime):
    sid = _session(runtime)
    for t in range(30):
        _grow(runtime, sid, t)
        runtime.turn(sid, "pace", Budget(BUDGET, RESERVE))
    stored = runtime.ledger.boundaries(sid)
    assert len(stored) >= 2
    for t in range(30, 45):  # previews (render) compile but never move the session's chain
        _grow(runtime, sid, t)
        runtime.turn(sid, "pace", Budget(BUDGET, RESERVE), record=False)
    assert runtime.ledger.boundaries(sid) == stored
    first = stored[0]
    past = runtime.turn(sid, "pace", Budget(BUDGET, RESERVE), at=first["t"] + 1, record=False)
    assert past.boundary.id == first["id"] and not past.compacted


def test_two_replicas_compacting_the_same_turn_at_once_serve_the_one_boundary_in_effect(ledger_url):
    """Two runtimes on one ledger compact the same turn concurrently, one of them planning without keys (the
    embedder-down fallback), so their boundaries differ. Both compile before either records (a barrier). One
    boundary is stored at that step, and both turns serve its prompt: the one that lost the race reads the
    winner back before it serves."""
    import threading

    cfg = {"type": "pace", "compaction": {"high": 0.85, "low": 0.55}}
    a, b = Runtime(Ledger(ledger_url)), Runtime(Ledger(ledger_url))
    sid = _session(a)
    for t in range(24):  # well past the high watermark: the first turn compacts
        _grow(a, sid, t)
    barrier = threading.Barrier(2, timeout=60)
    for rt in (a, b):
        compile_once = rt.compile

        def compiled(*args, _compile=compile_once, **kwargs):
            turn = _compile(*args, **kwargs)
            if turn.compacted:
                barrier.wait()  # both have compacted before either stores its boundary
            return turn

        rt.compile = compiled
    turns: dict[str, object] = {}

    def serve(name, rt, keys):
        turns[name] = rt.turn(sid, cfg, Budget(BUDGET, RESERVE), keys=keys)

    threads = [threading.Thread(target=serve, args=("a", a, True)),
               threading.Thread(target=serve, args=("b", b, False))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rows = a.ledger.boundaries(sid)
    assert len(rows) == 1, rows  # one boundary per (session, key, t)
    in_effect = Runtime(Ledger(ledger_url)).turn(sid, cfg, Budget(BUDGET, RESERVE), record=False)
    assert turns["a"].prompt.ids == turns["b"].prompt.ids == in_effect.prompt.ids
    for rt in (a, b):
        rt.ledger.close()


def test_the_ledger_itself_refuses_a_second_boundary_at_one_session_key_and_step(ledger_url):
    """Beyond the check under the session's lock, the schema refuses a second row at (session, key, t) from any
    writer (migration 0006); a boundary at another step is stored."""
    rt = Runtime(Ledger(ledger_url))
    sid = _session(rt)
    for t in range(24):
        _grow(rt, sid, t)
    rt.turn(sid, {"type": "pace"}, Budget(BUDGET, RESERVE))
    (row,) = rt.ledger.boundaries(sid)
    insert = "INSERT INTO boundaries (session_id, key, t, digest, body, created) VALUES (?,?,?,?,?,?)"
    with pytest.raises(Exception, match="one boundary per"):
        with rt.ledger._tx() as db:
            db.execute(insert, (sid, row["key"], row["t"], "other", b"other", 0.0))
    with rt.ledger._tx() as db:
        db.execute(insert, (sid, row["key"], row["t"] + 1, "later", b"later", 0.0))
    assert [r["t"] for r in rt.ledger.boundaries(sid)] == [row["t"], row["t"] + 1]
    rt.ledger.close()


def test_a_boundary_never_degrades_the_recent_steps_where_a_higher_target_holds_them(runtime):
    """PACE always shows its last N steps in full. When the low watermark cannot hold the prefix and those
    steps, the boundary compacts to the lowest higher target (tenths of the budget, at most halfway to the high
    watermark) that can, and the audit says so; a policy whose recents fit the low watermark compacts to it."""
    from palimpsest.platform.types import Resolution

    sid = _session(runtime)
    for t in range(14):
        runtime.append(sid, step(t, f"ls dir_{t}", f"file_{t}.py " * 12))
    for t in (14, 15):  # two large recent steps: together more than the low watermark leaves for history
        runtime.append(sid, step(t, f"cat big_{t}.log", " ".join(f"line{t}_{i}=value{i * 7}" for i in range(54))))
    cfg = {"type": "pace", "recent": 2}
    low = int(0.6 * BUDGET)
    # the premise: planned at the low watermark, PACE cannot keep both recent steps full
    at_low = runtime.turn(sid, per_turn("pace", recent=2), Budget(low, RESERVE), record=False)
    assert not (at_low.plan.resolution[-2:] == Resolution.FULL).all()
    turn = runtime.turn(sid, cfg, Budget(BUDGET, RESERVE))
    assert turn.compacted
    info = turn.plan.info["compaction"]
    assert (turn.plan.resolution[-2:] == Resolution.FULL).all(), turn.plan.resolution[-4:]
    assert info["recent"] == {"n": 2, "full": True, "first_target": low, "raised": True}
    assert low < info["target"] <= (low + int(0.9 * BUDGET)) // 2  # at most halfway: the epoch can still grow
    assert turn.prompt.tokens + RESERVE <= info["target"]
    (row,) = [r for r in runtime.ledger.audit(sid) if r["t"] == turn.t]
    assert row["compaction"]["recent"]["raised"] is True  # the audit records it
    # recents that fit the low watermark: compacted to it, not raised
    other = _session(runtime, "e2")
    for t in range(40):
        _grow(runtime, other, t)
    small = runtime.turn(other, cfg, Budget(BUDGET, RESERVE))
    assert small.compacted and small.plan.info["compaction"]["target"] == low
    assert small.plan.info["compaction"]["recent"]["raised"] is False


def test_a_sessions_first_turn_is_billed_in_full_and_an_unknown_previous_turn_is_not_guessed(ledger_url):
    """The first turn of a session has nothing cached: every id is uncached and billed in full. A replica that
    did not serve the previous turn cannot know what the cache holds: no cost rather than a wrong one."""
    a = Runtime(Ledger(ledger_url))
    sid = _session(a)
    for t in range(3):
        _grow(a, sid, t)
    first = a.turn(sid, {"type": "pace"}, Budget(BUDGET, RESERVE))
    n = len(first.prompt.ids)
    assert first.cost == {"cached": 0, "uncached": n, "billed": n, "prefix_reuse": 0.0}
    _grow(a, sid, 3)
    second = a.turn(sid, {"type": "pace"}, Budget(BUDGET, RESERVE))
    assert second.cost["cached"] > 0 and second.cost["uncached"] < len(second.prompt.ids)
    _grow(a, sid, 4)
    other = Runtime(Ledger(ledger_url))  # served none of this session's turns
    assert other.turn(sid, {"type": "pace"}, Budget(BUDGET, RESERVE)).cost is None
    for rt in (a, other):
        rt.ledger.close()


def test_a_requests_reserve_never_moves_the_boundaries_another_reserve_is_served_from(tmp_path):
    """Requests of one session may reserve different room (a client's max_tokens, an arm's soft positions).
    Each reserve's turns are served exactly as if it were alone: a larger reserve compacting earlier never
    stores a boundary that a smaller one's later turns extend, on this replica or another."""
    alone_rt = Runtime(Ledger(str(tmp_path / "alone.db")))
    url = str(tmp_path / "mixed.db")
    mixed, other = Runtime(Ledger(url)), Runtime(Ledger(url))
    for rt in (alone_rt, mixed):
        _session(rt)
    large, differed = RESERVE * 5, 0
    for t in range(40):
        for rt in (alone_rt, mixed):
            _grow(rt, "e1", t)
        alone = alone_rt.turn("e1", "pace", Budget(BUDGET, RESERVE))
        big = mixed.turn("e1", "pace", Budget(BUDGET, large))  # the larger reply, served first
        small = (mixed if t % 2 else other).turn("e1", "pace", Budget(BUDGET, RESERVE))
        assert small.prompt.ids == alone.prompt.ids and small.compacted == alone.compacted, f"t={t}"
        assert big.prompt.tokens + large <= BUDGET and small.prompt.tokens + RESERVE <= BUDGET
        differed += big.compacted != small.compacted
    assert differed, "the premise: the two reserves compact at different turns"
    keys = {r["key"] for r in mixed.ledger.boundaries("e1")}
    assert len(keys) == 2, keys  # one epoch chain per reserve
    for rt in (alone_rt, mixed, other):
        rt.ledger.close()


def _crowded_session(rt, sid="crowded"):
    """A session whose prefix leaves so little of the budget that every boundary compacts to the whole budget,
    past the high watermark."""
    rt.ledger.create_session(sid, TASK, system="You are careful. " + " ".join(f"rule{i}" for i in range(600)))
    return sid


def test_the_replica_that_loses_a_compaction_race_serves_the_winners_boundary_as_stored(tmp_path):
    """Replica b read the ledger before a stored its boundary at this step, and compacts the same turn (without
    keys, so differently). b serves a's boundary exactly, never a compaction of its own that is not stored,
    even where that boundary is past the high watermark; so does a retry of the turn at the same step."""
    url = str(tmp_path / "ledger.db")
    a, b = Runtime(Ledger(url)), Runtime(Ledger(url))
    sid = _crowded_session(a)
    for t in range(4):
        _grow(a, sid, t)
        won = a.turn(sid, "pace", Budget(BUDGET, RESERVE))
    assert won.compacted and won.prompt.tokens + RESERVE > int(0.9 * BUDGET)  # the premise: past the watermark
    _grow(a, sid, 4)
    won = a.turn(sid, "pace", Budget(BUDGET, RESERVE))
    read_late, b.boundary = b.boundary, lambda *args, **kwargs: None  # b's read predates a's boundary at t=4
    lost = b.turn(sid, "pace", Budget(BUDGET, RESERVE), keys=False)
    b.boundary = read_late
    stored = [r for r in a.ledger.boundaries(sid) if r["t"] == 5]
    assert len(stored) == 1
    in_effect = Boundary.decode(a.ledger.boundary_blob(sid, stored[0]["id"]), stored[0]["id"])
    assert tuple(won.prompt.messages) == in_effect.messages
    assert lost.prompt.ids == won.prompt.ids and lost.prompt.messages == won.prompt.messages
    assert not lost.compacted and lost.boundary.id == stored[0]["id"]
    again = b.turn(sid, "pace", Budget(BUDGET, RESERVE), keys=False)  # a retry at the same step
    assert again.prompt.ids == won.prompt.ids and not again.compacted
    assert len([r for r in a.ledger.boundaries(sid) if r["t"] == 5]) == 1
    for rt in (a, b):
        rt.ledger.close()


def test_on_a_ledger_holding_duplicate_boundaries_the_stored_row_and_the_row_in_effect_agree(tmp_path):
    """A ledger written before migration 0006 may hold two boundaries at one (session, key, t). The row that
    add_boundary answers a losing writer with is the row last_boundary puts in effect, and what is served."""
    from palimpsest.platform.ledger.backends import migrations

    url = str(tmp_path / "ledger.db")
    rt = Runtime(Ledger(url))
    sid = _session(rt)
    for t in range(24):
        _grow(rt, sid, t)
    first = rt.turn(sid, "pace", Budget(BUDGET, RESERVE))
    (row,) = rt.ledger.boundaries(sid)
    other = Boundary.decode(rt.ledger.boundary_blob(sid, row["id"]))
    other = Boundary(**{**other.__dict__, "messages": other.messages[:-1] + (
        {**other.messages[-1], "content": other.messages[-1]["content"] + " (the other replica's)"},), "id": None})
    (trigger,) = [sql for v, name, sql in migrations("sqlite") if v == 6]
    with rt.ledger._tx() as db:  # the duplicate as an older ledger could hold it: written before the trigger
        db.execute("DROP TRIGGER boundaries_unique")
        db.execute("INSERT INTO boundaries (session_id, key, t, digest, body, created) VALUES (?,?,?,?,?,?)",
                   (sid, row["key"], row["t"], other.digest, other.encode(), 0.0))
    with rt.ledger._tx() as db:
        db.execute(trigger)
    rows = [r["id"] for r in rt.ledger.boundaries(sid)]
    assert len(rows) == 2
    answered, stored = rt.ledger.add_boundary(sid, row["key"], first.boundary)
    assert not stored and answered == rt.ledger.last_boundary(sid, row["key"])
    served = Runtime(Ledger(url)).turn(sid, "pace", Budget(BUDGET, RESERVE), record=False)
    assert served.boundary.id == answered
    rt.ledger.close()
