from __future__ import annotations

import pytest

from pagedserve.core import Request, RequestStatus

STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def feed(request: Request, tokens: list[int]) -> list[RequestStatus | None]:
    return [request.append_output_token(t) for t in tokens]


def test_all_token_ids_is_prompt_then_outputs():
    r = Request("a", [1, 2, 3], max_tokens=5)
    feed(r, [7, 8])
    assert r.all_token_ids == [1, 2, 3, 7, 8] and r.output_token_ids == [7, 8]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (5, 3, 2)


def test_eos_stops_unless_ignored():
    assert feed(Request("a", [1], 5, eos_token_id=9), [4, 9]) == [None, STOPPED]
    assert feed(Request("a", [1], 5, eos_token_id=9, ignore_eos=True), [4, 9]) == [None, None]


def test_stop_token_ids_stop_and_record_the_reason():
    r = Request("a", [1], 5, stop_token_ids={6})
    assert feed(r, [6]) == [STOPPED] and r.stop_reason == 6


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    r = Request("a", [1], 10, min_tokens=3, eos_token_id=9, stop_token_ids={6})
    assert feed(r, [9, 6, 9]) == [None, None, STOPPED]


def test_max_tokens_ends_with_length():
    assert feed(Request("a", [1], 2), [4, 5]) == [None, LENGTH]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"priority": 1.5}, "priority"),
        ({"cache_salt": 3}, "cache_salt"),
    ],
)
def test_invalid_fields_raise_naming_them(kwargs, field):
    args = {"request_id": "a", "prompt_token_ids": [1], "max_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=field):
        Request(**args)


def test_finish_reasons():
    assert STOPPED.finish_reason == "stop" and LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.RUNNING.finish_reason is None and not RequestStatus.PREEMPTED.is_finished
