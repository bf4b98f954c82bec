import pytest

from palimpsest.platform.types import Authority, PalimpsestError
from palimpsest.serving.openai_proxy import HistoryConflict, new_steps, parse_messages
from palimpsest.serving.schemas import ChatMessage


def msgs(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


CHAT = msgs(("system", "be careful"), ("user", "fix the bug"), ("assistant", "ls"), ("user", "a.py b.py"),
            ("assistant", "cat a.py"), ("tool", "def f(): ..."))


def test_system_task_and_steps_from_a_message_list():
    p = parse_messages(CHAT)
    assert (p.system, p.task) == ("be careful", "fix the bug")
    assert [(s.t, s.action, s.observation) for s in p.steps] == [(0, "ls", "a.py b.py"), (1, "cat a.py", "def f(): ...")]
    # command output sent as a user message after an action is the tool's, not the principal's (default)
    assert p.steps[0].authority is Authority.TOOL and p.steps[1].authority is Authority.TOOL


def test_authority_comes_from_the_source_not_the_role():
    as_user = parse_messages(CHAT, user_after_action="user")
    assert as_user.steps[0].authority is Authority.USER and as_user.steps[1].authority is Authority.TOOL
    # a user turn before any action is the principal speaking
    p = parse_messages(msgs(("user", "fix the bug"), ("user", "and the docs"), ("assistant", "ls"), ("user", "a.py")))
    assert p.steps[0].authority is Authority.USER and p.steps[1].authority is Authority.TOOL


def test_a_trailing_action_without_observation_waits():
    p = parse_messages(CHAT + msgs(("assistant", "pytest")))
    assert len(p.steps) == 2


def test_resending_history_is_idempotent_and_rewriting_it_is_a_conflict():
    p = parse_messages(CHAT)
    recorded = [s.sha256() for s in p.steps[:1]]
    assert [s.t for s in new_steps(recorded, p.steps)] == [1]
    assert new_steps([s.sha256() for s in p.steps], p.steps) == []
    changed = parse_messages(CHAT[:3] + msgs(("user", "a.py c.py")) + CHAT[4:])
    with pytest.raises(HistoryConflict, match="t=0"):
        new_steps(recorded, changed.steps)
    with pytest.raises(HistoryConflict, match="cannot be removed"):
        new_steps([s.sha256() for s in p.steps], p.steps[:1])


def test_a_list_without_a_task_is_refused():
    with pytest.raises(PalimpsestError, match="user message"):
        parse_messages(msgs(("system", "x")))


def test_text_content_parts_are_read():
    p = parse_messages([ChatMessage(role="user", content=[{"type": "text", "text": "solve it"}])])
    assert p.task == "solve it"
