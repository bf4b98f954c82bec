import multiprocessing as mp

import numpy as np
import pytest

from palimpsest.platform import (
    Authority,
    Ledger,
    LedgerError,
    StepRecord,
    UnknownSessionError,
    UnknownStepError,
)
from palimpsest.platform.prompt.abstraction import RuleSummarizer
from tests.helpers import TASK, step


def _append_in_child(path: str, n: int) -> None:
    led = Ledger(path)
    led.create_session("child", "a task")
    for t in range(n):
        led.append("child", step(t, f"echo {t}", str(t)))
    led.close()


def test_append_is_durable_and_visible_to_another_process(ledger_url):
    path = ledger_url
    proc = mp.get_context("spawn").Process(target=_append_in_child, args=(path, 5))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    led = Ledger(path)
    assert led.count("child") == 5
    assert led.verify("child") == 5
    assert led.step_at("child", 4).observation == "4"


def test_reappend_same_content_is_a_noop(ledger):
    ledger.create_session("s", TASK)
    a = ledger.append("s", step(0, "ls", "x"))
    b = ledger.append("s", step(0, "ls", "x"))
    assert a.id == b.id and ledger.count("s") == 1


def test_reappend_different_content_is_an_error_and_keeps_the_original(ledger):
    ledger.create_session("s", TASK)
    ledger.append("s", step(0, "ls", "x"))
    with pytest.raises(LedgerError, match="different content"):
        ledger.append("s", step(0, "ls", "y"))
    assert ledger.step_at("s", 0).observation == "x"


def test_steps_are_appended_in_order(ledger):
    ledger.create_session("s", TASK)
    with pytest.raises(LedgerError, match="expected step t=0, got t=2"):
        ledger.append("s", step(2, "ls", "x"))
    assert ledger.count("s") == 0


def test_append_many_is_all_or_nothing(ledger):
    ledger.create_session("s", TASK)
    ledger.append("s", step(0, "ls", "x"))
    with pytest.raises(LedgerError):
        ledger.append_many("s", [step(1, "a", "b"), step(0, "ls", "changed")])
    assert ledger.count("s") == 1


def test_unknown_session_is_a_clear_error(ledger):
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
        ledger.append("nope", step(0, "ls"))
    with pytest.raises(UnknownSessionError):
        ledger.snapshot("nope")


def test_session_recreated_with_other_task_is_refused(ledger):
    ledger.create_session("s", TASK)
    ledger.create_session("s", TASK)  # same content: fine
    with pytest.raises(LedgerError, match="already exists"):
        ledger.create_session("s", "another task")


def test_raw_text_cannot_be_updated_or_deleted_even_through_sql(ledger):
    ledger.create_session("s", TASK)
    ledger.append("s", step(0, "ls", "x"))
    for sql in ("UPDATE steps SET observation='forged'", "DELETE FROM steps",
                "UPDATE representations SET text='forged'", "DELETE FROM sessions"):
        with pytest.raises(Exception, match="append-only"):
            with ledger._store.tx() as db:
                db.execute(sql)
    assert ledger.step_at("s", 0).observation == "x"


def test_steps_of_another_session_are_unknown(ledger):
    ledger.create_session("a", TASK)
    ledger.create_session("b", TASK)
    ledger.append("a", step(0, "ls", "secret of a"))
    sb = ledger.append("b", step(0, "ls", "b"))
    sa = ledger.step_at("a", 0)
    with pytest.raises(UnknownStepError, match=f"no step #{sa.id} in session 'b'"):
        ledger.step("b", sa.id)
    with pytest.raises(UnknownStepError):
        ledger.add_keys("b", [sa.id], "m", np.ones((1, 4), np.float32))
    assert [s.observation for s in ledger.snapshot("b").steps] == ["b"]
    assert ledger.step("b", f"#{sb.id}").id == sb.id


def test_snapshot_is_a_consistent_point_in_time(ledger):
    ledger.create_session("s", TASK)
    ledger.append("s", step(0, "ls", "x"))
    snap = ledger.snapshot("s")
    ledger.append("s", step(1, "pwd", "/"))
    assert snap.t == 1 and ledger.snapshot("s").t == 2
    assert ledger.snapshot("s", upto=1).t == 1


def test_every_step_has_a_placeholder_and_summaries_are_added_later(ledger):
    ledger.create_session("s", TASK)
    st = ledger.append("s", step(0, "cat settings/loader.py", "def parse_config(env): ..."))
    snap = ledger.snapshot("s")
    assert snap.body(0, snap_res("placeholder")) == f"[#{st.id} bash cat] settings/loader.py"
    assert snap.tokens[0, 1] == -1 and snap.abstraction(0) is None
    s = RuleSummarizer()
    ledger.add_summaries("s", st.id, s.summarize(st.record()), s.name, s.version)
    snap = ledger.snapshot("s")
    assert snap.tokens[0, 1] > 0 and "parse_config" in snap.body(0, snap_res("detailed"))
    assert snap.abstraction(0).identifiers[0] == "parse_config"
    assert snap.steps[0].observation == "def parse_config(env): ..."  # raw untouched


def snap_res(name):
    from palimpsest.platform import Resolution

    return Resolution.parse(name)


def test_keys_round_trip_as_float32(ledger):
    ledger.create_session("s", TASK)
    st = ledger.append("s", step(0, "ls", "x"))
    vec = np.arange(8, dtype=np.float32)[None] / 10
    ledger.add_keys("s", [st.id], "m8", vec)
    snap = ledger.snapshot("s", key_model="m8")
    assert snap.has_key.tolist() == [True] and np.array_equal(snap.keys[0], vec[0])
    assert not ledger.snapshot("s", key_model="other").has_key.any()
    with pytest.raises(LedgerError, match="finite"):
        ledger.add_keys("s", [st.id], "bad", np.full((1, 8), np.nan, np.float32))


def test_invalid_records_are_refused_with_the_reason(ledger):
    ledger.create_session("s", TASK)
    with pytest.raises(LedgerError, match="invalid kind"):
        ledger.append("s", step(0, "ls", "x", kind="Not A Kind!"))
    with pytest.raises(LedgerError, match="invalid session id"):
        ledger.create_session("bad id with spaces", TASK)
    with pytest.raises(LedgerError, match="task must be"):
        ledger.create_session("s2", "  ")


def test_tokenizer_is_bound_to_the_ledger(tmp_path, ledger_url):
    path = ledger_url
    Ledger(path).close()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _tiny_tokenizer(tok_dir / "tokenizer.json")
    with pytest.raises(LedgerError, match="counts tokens with 'approx-v1'"):
        Ledger(path, tokenizer=str(tok_dir))


def _tiny_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["def parse_config(env): return env['database_url']"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(path))


def test_authority_is_stored_with_the_step(ledger):
    ledger.create_session("s", TASK)
    st = ledger.append("s", step(0, "reply", "ok, thanks", kind="respond", authority=Authority.USER))
    assert st.authority is Authority.USER and st.tokens["full"] > 0


def test_concurrent_appends_without_t_each_get_the_next_t(ledger_url):
    """24 writers append to one session at once without naming t: all 24 are stored, t = 0..23, none refused."""
    from concurrent.futures import ThreadPoolExecutor

    setup = Ledger(ledger_url)
    setup.create_session("c", "task")

    def write(i: int) -> int:
        led = Ledger(ledger_url)  # one connection per writer, as replicas have
        try:
            return led.append_next("c", StepRecord(t=0, kind="bash", action=f"echo {i}", observation=str(i))).t
        finally:
            led.close()

    with ThreadPoolExecutor(8) as pool:
        ts = list(pool.map(write, range(24)))
    assert sorted(ts) == list(range(24))
    assert sorted(s.action for s in setup.snapshot("c").steps) == sorted(f"echo {i}" for i in range(24))
    setup.close()


def test_steps_are_read_in_pages(ledger):
    ledger.create_session("p", "task")
    ledger.append_many("p", [step(t, f"echo {t}", str(t)) for t in range(7)])
    assert [s.t for s in ledger.steps("p", 0, 3)] == [0, 1, 2]
    assert [s.action for s in ledger.steps("p", 5, 10)] == ["echo 5", "echo 6"]
    assert ledger.steps("p", 7, 3) == []
    with pytest.raises(UnknownSessionError):
        ledger.steps("nope")
