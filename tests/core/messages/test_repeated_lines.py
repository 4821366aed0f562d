"""Runs of whole lines of a new tool result found in an earlier one, their pointers and check."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.messages import MessagePlanner, message_planner
from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.pointers import (
    ELLIPSIS,
    RequestView,
    result_pointer,
)
from contextpilot_integrations.core.messages.repeated_lines import (
    MAX_POSITIONS,
    SAME_LINES,
    EarlierResult,
    LineIndex,
    LineRun,
    check_run,
    check_run_placement,
    find_runs,
    parse_run_pointer,
    replace_runs,
    run_pointer,
    split_lines,
)
from contextpilot_integrations.core.request import Scope

COUNT = ApproxTokenCounter().count
CALL = 'read_file({"path": "a.py"})'


def _file(n: int, stem: str = "value") -> str:
    return "".join(
        f"    {stem}_{i:04d} = compute_something_long({i}, flag=True)\n" for i in range(n)
    )


def _runs(text: str, earlier: str, call: str = CALL, minimum: int = 16) -> list[LineRun]:
    return find_runs(text, [EarlierResult(call, earlier)], COUNT, minimum)


def _checks(text: str, runs: list[LineRun], earlier: str, call: str = CALL) -> bool:
    return all(check_run({call: [earlier]}, r.pointer, text[r.start : r.end]) for r in runs)


def test_split_lines_keeps_every_byte() -> None:
    for text in ("", "a", "a\n", "a\r\nb", "a\n\nb\n", "x\x0by\u2028z\n"):
        assert "".join(split_lines(text)) == text
    assert split_lines("a\x0bb\u2028c\n") == ["a\x0bb\u2028c\n"]  # only "\n" ends a line


def test_exact_round_trip() -> None:
    earlier = "import os\n" + _file(40) + "    return x\n"
    runs = _runs(earlier, earlier)
    assert len(runs) == 1
    run = runs[0]
    assert (run.start, run.end, run.source_start, run.source_end) == (
        0,
        len(earlier),
        0,
        len(earlier),
    )
    assert run.lines == 42
    assert run.pointer == (
        f"[Same 42 lines as in the result of {CALL} above, from the line "
        'starting "import os" to the line starting "    return x".]\n'
    )
    assert replace_runs(earlier, runs) == run.pointer
    assert run.tokens_saved == COUNT(earlier) - COUNT(run.pointer) >= 16
    assert check_run({CALL: [earlier]}, run.pointer, earlier)
    assert parse_run_pointer(run.pointer) == (42, CALL, "import os", "    return x", "\n")


def test_edit_in_the_middle_of_a_file_gives_two_runs_around_it() -> None:
    lines = split_lines(_file(60))
    edited = lines[:30] + ["    value_0030 = changed()\n"] + lines[31:]
    earlier, text = "".join(lines), "".join(edited)
    runs = _runs(text, earlier)
    assert [(r.lines, r.start, r.end) for r in runs] == [
        (30, 0, len("".join(lines[:30]))),
        (29, len("".join(edited[:31])), len(text)),
    ]
    sent = replace_runs(text, runs)
    assert "    value_0030 = changed()\n" in sent
    assert sent.count("[Same ") == 2
    assert _checks(text, runs, earlier)
    first = runs[0].pointer
    # a 60-character line cut at 24 characters names its line: every line starts differently
    assert f'from the line starting "    value_0000 = compute{ELLIPSIS}"' in first
    assert f'to the line starting "    value_0029 = compute{ELLIPSIS}"' in first


def test_crlf_lines_keep_their_endings() -> None:
    earlier = _file(30).replace("\n", "\r\n")
    text = "header\r\n" + earlier + "footer"
    runs = _runs(text, earlier)
    assert len(runs) == 1 and runs[0].lines == 30
    assert runs[0].pointer.endswith(".]\r\n")
    assert "\r" not in runs[0].pointer[:-2]  # quotes leave the line ending out
    sent = replace_runs(text, runs)
    assert sent.startswith("header\r\n[Same 30 lines") and sent.endswith(".]\r\nfooter")
    assert _checks(text, runs, earlier)
    # the same lines with "\n" endings are other bytes: no run
    assert _runs(text.replace("\r\n", "\n"), earlier) == []


def test_a_run_at_the_end_without_a_newline() -> None:
    earlier = _file(20).rstrip("\n")
    runs = _runs("intro\n" + earlier, earlier)
    assert len(runs) == 1 and runs[0].pointer.endswith(".]")
    assert _checks("intro\n" + earlier, runs, earlier)


def test_a_line_repeated_many_times_is_bounded() -> None:
    line = "x = 1  # the same line, over and over again\n"
    same = line * 100_000
    started = time.perf_counter()
    runs = _runs(same, same)
    assert time.perf_counter() - started < 20  # linear: a quadratic search takes hours
    # every line reads the same: no quote tells one from another, so no run
    assert runs == []
    # a distinct first and last line around them make a run that can be named
    earlier = "first line of the file, unique\n" + line * 200 + "last line of it, unique\n"
    runs = _runs(earlier, earlier)
    assert len(runs) == 1 and runs[0].lines == 202
    assert _checks(earlier, runs, earlier)
    assert MAX_POSITIONS == 64


def test_many_identical_lines_in_the_earlier_result_cap_the_candidates() -> None:
    earlier = "}\n" * 5_000 + _file(10)
    text = "}\n" + _file(10)
    runs = _runs(text, earlier)
    # the run starting at "}" is found from the last "}" only if that is among the first
    # MAX_POSITIONS places; it is not, so the run starts after it
    assert [r.lines for r in runs] == [10]
    assert runs[0].start == 2
    assert _checks(text, runs, earlier)


def test_ambiguous_quotes_are_lengthened() -> None:
    common = "    result = compute_the_value(alpha, beta, "  # 44 characters shared
    earlier = (
        f"{common}gamma)\n"  # an earlier line sharing the first 44 characters
        + "".join(f"    other_{i} = lines_in_between_here({i}, more_text)\n" for i in range(12))
        + f"{common}delta)\n"
        + "".join(f"    tail_{i} = lines_after_the_start_line({i}, more)\n" for i in range(12))
    )
    text = "".join(split_lines(earlier)[13:])
    runs = _runs(text, earlier)
    assert len(runs) == 1 and runs[0].lines == 13
    quote = parse_run_pointer(runs[0].pointer)
    assert quote is not None and quote.first == f"{common}delta)"[:48] + ELLIPSIS
    assert _checks(text, runs, earlier)


def test_a_first_line_standing_earlier_is_trimmed_and_a_repeated_last_line_too() -> None:
    body = "".join(f"    step_{i:03d} = do_the_following_thing({i})\n" for i in range(20))
    repeated = "    pass  # a line that stands twice\n"
    earlier = text = repeated + body + repeated
    runs = _runs(text, earlier)
    # the last line's first match at or after the run's first line is that first line
    # itself: the last line is trimmed off
    assert len(runs) == 1
    stated = parse_run_pointer(runs[0].pointer)
    assert stated is not None
    assert runs[0].lines == 21 and not stated.last.startswith("    pass")
    assert _checks(text, runs, earlier)
    # a run whose first line stands earlier in the result is trimmed at its start
    later = repeated + "    other = something_else_entirely()\n" + repeated + body
    text = repeated + body
    runs = _runs(text, later)
    assert [(r.start, r.lines) for r in runs] == [(len(repeated), 20)]
    assert _checks(text, runs, later)


def test_quotes_and_calls_that_hold_the_template_are_refused() -> None:
    tricky = '    x = "a" to the line starting "b".] and more text here\n'
    earlier = tricky + _file(20)
    runs = _runs(earlier, earlier)
    for run in runs:
        stated = parse_run_pointer(run.pointer)
        assert stated is not None and stated.lines == run.lines
    assert _checks(earlier, runs, earlier)
    # a last line holding '".]' would end the pointer early for a reader: trimmed off
    closing = '    print("done".] or so, a line that closes with a quote)\n'
    earlier = _file(20) + closing
    runs = _runs(earlier, earlier)
    assert [r.lines for r in runs] == [20]
    assert _checks(earlier, runs, earlier)
    call = 'f(x above, from the line starting "y)'
    assert _runs(_file(20), _file(20), call=call) == []


def test_unicode_lines() -> None:
    earlier = "".join(f"ligne {i} — été à Zürich 日本語のテキスト {i}\n" for i in range(30))
    text = "nouveau\n" + earlier
    runs = _runs(text, earlier)
    assert len(runs) == 1 and runs[0].lines == 30
    assert "— été" in runs[0].pointer
    assert _checks(text, runs, earlier)
    assert replace_runs(text, runs).startswith("nouveau\n[Same 30 lines")


def test_a_run_too_short_to_pay_is_not_replaced() -> None:
    earlier = "a = 1\nb = 2\nc = 3\n"
    assert _runs(earlier, earlier) == []
    long = _file(3)
    assert _runs(long, long) == []  # three lines: the pointer costs about as much
    assert _runs(_file(40), _file(40), minimum=10_000) == []


def test_two_readings_of_one_call_are_no_target() -> None:
    earlier = [EarlierResult(CALL, _file(30)), EarlierResult(CALL, _file(31))]
    assert find_runs(_file(30), earlier, COUNT, 16) == []
    same_twice = [EarlierResult(CALL, _file(30)), EarlierResult(CALL, result_pointer(CALL))]
    assert len(find_runs(_file(30), same_twice, COUNT, 16)) == 1


def test_the_longest_run_over_several_earlier_results() -> None:
    other = 'read_file({"path": "b.py"})'
    a, b = _file(10, "alpha"), _file(40, "alpha")
    runs = find_runs(b, [EarlierResult(CALL, a), EarlierResult(other, b)], COUNT, 16)
    assert len(runs) == 1 and runs[0].source == 1 and runs[0].lines == 40
    assert other in runs[0].pointer


def test_check_fails_when_the_earlier_result_is_absent_or_differs() -> None:
    earlier = "import os\n" + _file(30) + "    return x\n"
    text = "start\n" + earlier
    (run,) = _runs(text, earlier)
    original = text[run.start : run.end]
    assert check_run({CALL: [earlier]}, run.pointer, original)
    assert not check_run({}, run.pointer, original)
    assert not check_run({'read_file({"path": "b.py"})': [earlier]}, run.pointer, original)
    assert not check_run({CALL: [None]}, run.pointer, original)
    assert not check_run({CALL: [earlier.replace("value_0010", "value_x")]}, run.pointer, original)
    assert not check_run({CALL: [earlier, _file(3)]}, run.pointer, original)  # two readings
    assert not check_run({CALL: [_file(30) + "    return x\n"]}, run.pointer, original)
    assert not check_run({CALL: [earlier]}, run.pointer, original[:-1])
    assert not check_run({CALL: [earlier]}, run.pointer.rstrip("\n"), original)  # ending
    assert not check_run({CALL: [earlier]}, run.pointer.replace("32 lines", "31 lines"), original)
    assert not check_run({CALL: [earlier]}, "[Same result as x() above.]", "")
    # a whole-result pointer to the call reads as that call
    assert check_run({CALL: [earlier, result_pointer(CALL)]}, run.pointer, original)
    # a short name stands for every signature starting with its prefix
    short = 'read_file({"path": "a' + ELLIPSIS + ")"
    stated = parse_run_pointer(run.pointer)
    assert stated is not None
    pointer = run_pointer(stated.lines, short, stated.first, stated.last, stated.ending)
    assert check_run({CALL: [earlier]}, pointer, original)
    assert not check_run(
        {CALL: [earlier], 'read_file({"path": "ab"})': [_file(2)]}, pointer, original
    )


_LINE = st.sampled_from(
    [
        "import os\n",
        "    return compute_the_value(alpha, beta)\n",
        "    return compute_the_value(alpha, gamma)\n",
        "}\n",
        "\n",
        "    # a comment about what follows here\n",
        "    x = 'é日本' * 3 + \"quoted\" text\n",
        "line with crlf ending and some words\r\n",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, max_size=60), st.lists(_LINE, max_size=60), st.integers(0, 20))
def test_runs_always_check_and_map_back(
    earlier_lines: list[str], new_lines: list[str], minimum: int
) -> None:
    earlier = "".join(earlier_lines)
    text = "".join(new_lines)
    runs = _runs(text, earlier, minimum=minimum)
    position = 0
    for run in runs:
        assert position <= run.start < run.end
        position = run.end
        original = text[run.start : run.end]
        assert earlier[run.source_start : run.source_end] == original
        assert check_run({CALL: [earlier]}, run.pointer, original)
        assert run.tokens_saved >= minimum
    assert (replace_runs(text, runs) == text) == (not runs)


def _read(call_id: str, path: str = "a.py") -> dict[str, Any]:
    function = {"name": "read_file", "arguments": json.dumps({"path": path})}
    call = {"id": call_id, "type": "function", "function": function}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _request(earlier: str, sent: str, path: str = "a.py") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "edit a.py"},
        _read("c1", path),
        {"role": "tool", "tool_call_id": "c1", "content": earlier},
        _read("c2"),
        {"role": "tool", "tool_call_id": "c2", "content": sent},
    ]


def test_a_run_placement_is_checked_on_the_request() -> None:
    earlier = _file(30)
    text = "# edited\n" + earlier
    (run,) = _runs(text, earlier)
    sent = replace_runs(text, [run])
    placement = ResultPlacement(
        4,
        None,
        "c2",
        0,
        None,
        "pointer",
        False,
        SAME_LINES,
        target_message=2,
        target_call=CALL,
        original=text[run.start : run.end],
        pointer=run.pointer,
        offset=run.start,
        tokens_saved=run.tokens_saved,
    )
    assert check_run_placement(RequestView(_request(earlier, sent), "openai"), placement)
    # the earlier result differs, is another call's, or the pointer is not where it says
    changed = earlier.replace("value_0007", "value_x")
    assert not check_run_placement(RequestView(_request(changed, sent), "openai"), placement)
    other = RequestView(_request(earlier, sent, path="b.py"), "openai")
    assert not check_run_placement(other, placement)
    view = RequestView(_request(earlier, sent), "openai")
    assert not check_run_placement(view, replace(placement, offset=run.start + 1))
    assert not check_run_placement(view, replace(placement, target_message=4))
    glued = RequestView(_request(earlier, sent[: run.start] + "x" + sent[run.start :]), "openai")
    assert not check_run_placement(glued, replace(placement, offset=run.start + 1))


def test_a_run_pointer_without_a_line_ending_ends_its_result() -> None:
    earlier = _file(30).rstrip("\n")
    text = "# edited\n" + earlier
    (run,) = _runs(text, earlier)
    assert not run.pointer.endswith("\n")
    placement = ResultPlacement(
        4,
        None,
        "c2",
        0,
        None,
        "pointer",
        False,
        SAME_LINES,
        target_message=2,
        target_call=CALL,
        original=text[run.start : run.end],
        pointer=run.pointer,
        offset=run.start,
    )
    sent = replace_runs(text, [run])
    assert check_run_placement(RequestView(_request(earlier, sent), "openai"), placement)
    # text glued after it would read as part of the run's last line
    glued = RequestView(_request(earlier, sent + "more"), "openai")
    assert not check_run_placement(glued, placement)


# ------------------------------------------------------------------ in the planner
def _tool_call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    call = {"id": call_id, "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _session(first: str, second: str, tool_name: str = "read_file") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix a.py."},
        _tool_call("c1", tool_name, path="a.py"),
        {"role": "tool", "tool_call_id": "c1", "content": first},
        _tool_call("c2", "edit_file", path="a.py"),
        {"role": "tool", "tool_call_id": "c2", "content": "Edited a.py."},
        _tool_call("c3", tool_name, path="a.py"),
        {"role": "tool", "tool_call_id": "c3", "content": second},
    ]


def _edited(n: int = 60, at: int = 30) -> tuple[str, str]:
    lines = split_lines(_file(n))
    return "".join(lines), "".join(lines[:at] + ["    value = changed()\n"] + lines[at + 1 :])


def test_the_planner_sends_a_re_read_file_as_runs_around_the_edit() -> None:
    planner = MessagePlanner()
    before, after = _edited()
    messages = _session(before, after)
    plan = planner.plan(messages, scope=Scope(conversation_id="files", tenant="t"))
    sent = plan.messages[7]["content"]
    runs = [p for p in plan.pointers if p.reason == SAME_LINES]
    assert [(p.message, p.document, p.target_message) for p in runs] == [(7, 0, 3), (7, 1, 3)]
    assert sent.count("[Same 30 lines") == 1 and sent.count("[Same 29 lines") == 1
    assert "    value = changed()\n" in sent
    assert plan.messages[:7] == messages[:7]  # only the new result changes
    assert plan.tokens_removed == sum(p.tokens_saved for p in runs) > 0
    view = RequestView(plan.messages, "openai")
    for p in runs:
        assert check_run_placement(view, p)
        assert sent[p.offset :].startswith(p.pointer)
        assert p.original is not None and p.original in before
    # the pointers put back give the file as read
    restored = sent
    for p in sorted(runs, key=lambda p: -(p.offset or 0)):
        assert p.offset is not None and p.pointer is not None and p.original is not None
        restored = restored[: p.offset] + p.original + restored[p.offset + len(p.pointer) :]
    assert restored == after


def test_the_next_call_replays_the_runs_byte_identically() -> None:
    planner = MessagePlanner()
    scope = Scope(conversation_id="files", tenant="t")
    before, after = _edited()
    messages = _session(before, after)
    sent = planner.plan(messages, scope=scope).messages
    more = [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    for later in (messages + more, sent + more):  # as the app has it, or as it was sent
        plan = planner.plan(later, scope=scope)
        assert plan.replayed >= 8 and plan.messages[:8] == sent
        assert plan.messages[8:] == more
        view = RequestView(plan.messages, "openai")
        assert all(check_run_placement(view, p) for p in plan.pointers)


def test_plain_retriever_output_repeating_passages_points_at_them() -> None:
    passages = [
        "".join(f"Passage {i}, line {j}: the cache keeps keys and values.\n" for j in range(6))
        for i in range(4)
    ]
    first = "\n".join(passages[:3])  # texts joined by blank lines, no labels
    second = "\n".join([passages[3], passages[1], passages[2]])
    plan = MessagePlanner().plan(_session(first, second, tool_name="search"))
    runs = [p for p in plan.pointers if p.reason == SAME_LINES]
    assert len(runs) == 1 and runs[0].original == "\n".join(passages[1:3])
    sent = plan.messages[7]["content"]
    assert sent.startswith(passages[3] + "\n[Same 13 lines as in the result of ")
    assert check_run_placement(RequestView(plan.messages, "openai"), runs[0])


def test_a_run_that_fails_its_check_goes_out_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    real = message_planner.check_run_placement
    monkeypatch.setattr(
        message_planner,
        "check_run_placement",
        lambda view, p: p.document != 0 and real(view, p),
    )
    before, after = _edited()
    plan = MessagePlanner().plan(_session(before, after))
    sent = plan.messages[7]["content"]
    assert [p.document for p in plan.pointers] == [1]
    kept = [p for p in plan.placements if p.message == 7 and p.document == 0]
    assert [(p.status, p.reason) for p in kept] == [("kept", "not verified")]
    assert sent.startswith("".join(split_lines(after)[:31]))  # the first run in full
    assert plan.tokens_removed == plan.pointers[0].tokens_saved


def test_runs_leave_json_results_and_the_models_messages_alone() -> None:
    rows = [{"id": i, "text": f"row {i} of the table, with some words"} for i in range(40)]
    first = json.dumps(rows, indent=2)
    second = json.dumps(rows[:20] + [{"id": 99, "text": "new"}] + rows[20:], indent=2)
    plan = MessagePlanner().plan(_session(first, second, tool_name="query"))
    assert plan.messages[7]["content"] == second
    assert not [p for p in plan.pointers if p.reason == SAME_LINES]


def test_anthropic_results_get_runs_too() -> None:
    before, after = _edited()
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Fix a.py."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "u1", "name": "read_file", "input": {"p": 1}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "u1", "content": before}],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "u2", "name": "read_file", "input": {"p": 1}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "u2", "content": after}],
        },
    ]
    plan = MessagePlanner().plan(messages, api="anthropic")
    runs = [p for p in plan.pointers if p.reason == SAME_LINES]
    assert [(p.message, p.block, p.target_message, p.target_block) for p in runs] == [
        (4, 0, 2, 0),
        (4, 0, 2, 0),
    ]
    view = RequestView(plan.messages, "anthropic")
    assert all(check_run_placement(view, p) for p in runs)


def test_a_line_index_takes_results_in_one_at_a_time() -> None:
    index = LineIndex()
    assert index.find(_file(30), COUNT, 16) == []
    assert index.add("f(1)", _file(10, "alpha")) == 0
    assert index.add("f(2)", _file(30)) == 1
    (run,) = index.find("intro\n" + _file(30), COUNT, 16, name=lambda key: key.upper())
    assert run.source == 1 and "result of F(2) above" in run.pointer
    index.add("f(2)", _file(31))  # the call now reads two ways: no run into it
    assert index.find("intro\n" + _file(30), COUNT, 16) == []


def test_planning_many_new_results_stays_linear() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read them all."}]
    for r in range(150):
        text = "".join(
            f"line {r} {j} of a file, with some code = compute({j})\n" for j in range(150)
        )
        messages.append(_tool_call(f"c{r}", "read_file", path=f"f{r}.py"))
        messages.append({"role": "tool", "tool_call_id": f"c{r}", "content": text})
    started = time.perf_counter()
    plan = MessagePlanner().plan(messages)
    assert time.perf_counter() - started < 10  # each result's lines indexed once, not per result
    assert not plan.pointers


# ------------------------------------------------------------------ one line, a passage
def _passages(n: int, stem: str = "Passage") -> list[str]:
    return [
        f"{stem} {i}: the prefix cache keeps the keys and values of every token it has seen, "
        "so a prompt that starts the same way is not computed again; an agent that searches "
        "twice gets many of the same passages back, in another order, beside new ones, and "
        f"each passage is one line of the tool's output ({i})."
        for i in range(n)
    ]


def test_a_repeated_passage_gets_a_one_line_pointer_the_model_can_find() -> None:
    passages = _passages(6)
    earlier = "\n\n".join(passages[:3])  # a plain retriever's output: one line per passage
    text = "\n\n".join([passages[4], passages[1], passages[5]])
    runs = _runs(text, earlier, call='search({"query": "kv"})')
    assert len(runs) == 1 and runs[0].lines == 1
    run = runs[0]
    assert text[run.start : run.end] == passages[1] + "\n"
    stated = parse_run_pointer(run.pointer)
    assert stated is not None and stated.lines == 1 and stated.first == stated.last
    assert run.pointer.startswith(
        '[Same line as in the result of search({"query": "kv"}) above, the '
        f'line starting "{passages[1][:24]}{ELLIPSIS}".]'
    )
    # the quote finds the passage in the earlier result, verbatim
    assert earlier[run.source_start : run.source_end] == passages[1] + "\n"
    assert earlier.find("\n" + stated.first[:-1]) + 1 == run.source_start
    assert check_run({'search({"query": "kv"})': [earlier]}, run.pointer, passages[1] + "\n")
    sent = replace_runs(text, runs)
    assert sent.startswith(passages[4] + "\n\n[Same line") and sent.endswith("\n\n" + passages[5])


def test_a_passage_that_is_only_similar_gets_no_pointer() -> None:
    passages = _passages(3)
    earlier = "\n\n".join(passages)
    similar = passages[1].replace("every token", "each token")
    assert _runs("\n\n".join(["New passage, not seen before.", similar]), earlier) == []
    assert _runs(passages[1][:-1], earlier) == []  # a line cut short is another line


def test_a_passage_ending_one_result_is_the_same_line_in_the_middle_of_another() -> None:
    passages = _passages(4)
    call = 'search({"query": "kv"})'
    # the earlier result's last passage (no line ending) stands first in the new one
    earlier = "\n\n".join(passages[:2])
    text = "\n\n".join([passages[1], passages[3]])
    (run,) = _runs(text, earlier, call=call)
    assert text[run.start : run.end] == passages[1]  # the ending stays after the pointer
    assert not run.pointer.endswith("\n") and passages[1] in earlier
    sent = replace_runs(text, [run])
    assert sent == run.pointer + "\n\n" + passages[3]
    assert check_run({call: [earlier]}, run.pointer, passages[1])
    # and the other way round: a passage in the middle of one ends the next
    earlier = "\n\n".join(passages[:3])
    text = "\n\n".join([passages[3], passages[1]])
    (run,) = _runs(text, earlier, call=call)
    assert text[run.start : run.end] == passages[1] and replace_runs(text, [run]).endswith(".]")
    assert check_run({call: [earlier]}, run.pointer, passages[1])


def test_a_shorter_run_from_another_result_is_tried_when_the_longest_cannot_be_quoted() -> None:
    passages = _passages(5)
    one, two = 'search({"query": "one"})', 'search({"query": "two"})'
    # in the first result passage 2 stands twice (its first copy elsewhere); in the second,
    # once, with other neighbours
    first = "\n\n".join([passages[2], passages[0], passages[2], passages[3]])
    second = "\n\n".join([passages[4], passages[2]])
    text = "\n\n".join([passages[2], passages[3]])
    runs = find_runs(text, [EarlierResult(one, first), EarlierResult(two, second)], COUNT, 16)
    # the longest match (the second copy of passage 2 and passage 3, in the first result)
    # cannot be quoted at its start; passage 2 is pointed at where a quote finds it, then 3
    assert [(r.start, r.lines) for r in runs] == [(0, 1), (len(passages[2]) + 2, 1)]
    for run in runs:
        call, earlier = (one, first) if run.source == 0 else (two, second)
        assert check_run({call: [earlier]}, run.pointer, text[run.start : run.end])


def test_a_web_page_whose_menu_lines_repeat_is_cut_to_its_last_line_with_a_quote() -> None:
    menu = "".join(f"Menu entry {k}\n\n" for k in range(20))
    pages = [
        f"Page {p}: a long title of the page that names it well, {p}\n\n" + menu for p in range(3)
    ]
    earlier = "".join(pages)
    runs = _runs(earlier, earlier)
    assert runs and runs[0].start == 0
    assert runs[0].lines > 2 * 41  # past the first page's menu, to the last page's title
    assert _checks(earlier, runs, earlier)


def test_the_planner_points_at_repeated_passages_and_replays_them() -> None:
    planner = MessagePlanner()
    scope = Scope(conversation_id="rag", tenant="t")
    passages = _passages(6)
    first = "\n\n".join(passages[:3])
    second = "\n\n".join([passages[3], passages[2], passages[4], passages[0]])
    messages = _session(first, second, tool_name="search")
    plan = planner.plan(messages, scope=scope)
    runs = [p for p in plan.pointers if p.reason == SAME_LINES]
    assert len(runs) == 2 and all(p.pointer.startswith("[Same line as") for p in runs)
    sent = plan.messages[7]["content"]
    assert sent.index(passages[3]) < sent.index(runs[0].pointer) < sent.index(passages[4])
    view = RequestView(plan.messages, "openai")
    for p in runs:
        assert check_run_placement(view, p) and p.original in first
    restored = sent
    for p in sorted(runs, key=lambda p: -(p.offset or 0)):
        assert p.offset is not None and p.pointer is not None and p.original is not None
        restored = restored[: p.offset] + p.original + restored[p.offset + len(p.pointer) :]
    assert restored == second
    later = planner.plan(messages + [{"role": "assistant", "content": "Done."}], scope=scope)
    assert later.replayed == 8 and later.messages[:8] == plan.messages


def test_many_repeated_passages_and_many_tiny_lines_stay_bounded() -> None:
    passages = _passages(3_000)
    earlier = "\n\n".join(passages)
    shuffled = passages[1::2] + passages[::2]
    text = "\n\n".join(shuffled)
    started = time.perf_counter()
    runs = _runs(text, earlier)
    assert time.perf_counter() - started < 20
    assert len(runs) >= 3_000 - 2
    tiny = "\n\n".join(f"p{i % 50}" for i in range(100_000))
    started = time.perf_counter()
    assert _runs(tiny, tiny) == []  # no line pays for a pointer, and none is quoted
    assert time.perf_counter() - started < 20
    # lines sharing a long start: a quote is looked for among a bounded number of them
    common = "x" * 300
    lines = [f"{common}{i} and the rest of the line, long enough to pay\n" for i in range(5_000)]
    started = time.perf_counter()
    _runs("".join(lines[::-1]), "".join(lines))
    assert time.perf_counter() - started < 20
    messages = _session(earlier, text, tool_name="search")
    started = time.perf_counter()
    plan = MessagePlanner().plan(messages)
    assert time.perf_counter() - started < 30  # checked and recorded in linear passes
    assert all(p.reason == SAME_LINES for p in plan.pointers) and len(plan.pointers) >= 2_000


def test_a_quote_never_holds_a_pointer() -> None:
    pointer_line = "[2] [Same as document [1] of f(1) above.]\n"
    earlier = pointer_line + _file(20)
    for run in _runs(earlier, earlier):
        stated = parse_run_pointer(run.pointer)
        assert stated is not None and "[Same " not in stated.first + stated.last
        assert run.pointer.count("[Same ") == 1
