"""Token-id prompts through the front: the ids that reach the scheduler, and the refusals.

A prompt of thousands of ids arrives with every turn of a conversation, so what the front does
per id is on every request's path (check_prompt_ids; expand_image_token_ids, which skips its
loop when there are no images). These pin what any faster form must keep: exactly the ids sent
reach the scheduler, and a bad list is refused with the same status, message and param.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from serving.front.api.errors import APIError
from serving.front.api.sampling import check_prompt_ids
from serving.front.engine_client import EngineClient
from serving.front.http_server import create_app
from serving.front.images import expand_image_token_ids
from serving.protocol import FinishReason, GenerateRequest, SchedulerReady, SequenceOutput
from serving.server_args import ServerArgs

VOCAB = 1024
READY = SchedulerReady(
    vocab_size=VOCAB,
    context_length=8192,
    eos_token_ids=[0],
    max_running_requests=8,
    total_rows=9,
    total_pages=64,
    page_size=16,
    device="cpu",
    dtype="float32",
)


class RecordingClient(EngineClient):
    """Keeps every request that reaches the scheduler; each answers one token."""

    def __init__(self) -> None:
        super().__init__("ipc:///unused-send", "ipc:///unused-recv")
        self.mark_ready(READY)
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[SequenceOutput]:
        self.requests.append(req)
        yield SequenceOutput(req.rid, [7], True, FinishReason.length(), len(req.input_ids), 1)


@pytest.fixture(scope="module")
def front(model_dir: Path) -> tuple[Any, RecordingClient]:
    from fastapi.testclient import TestClient

    engine = RecordingClient()
    args = ServerArgs(model_path=str(model_dir), served_model_name="tiny")
    return TestClient(create_app(args, engine)), engine


def _reference_check(ids: list[int], vocab_size: int) -> int | None:
    """The first id outside the vocabulary, element by element (what the check must name)."""
    return next((t for t in ids if not 0 <= t < vocab_size), None)


def test_check_prompt_ids_names_the_first_id_outside_the_vocabulary() -> None:
    rng = random.Random(3)
    lists = [[], [0], [VOCAB - 1], [VOCAB], [-1], [5, VOCAB + 3, -2, VOCAB], [3, -7, VOCAB, 2]]
    for _ in range(200):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 64))]
        for _ in range(rng.randrange(3)):
            ids[rng.randrange(len(ids))] = rng.choice([-1, -(2**40), VOCAB, VOCAB + 9, 2**63])
        lists.append(ids)
    for ids in lists:
        bad = _reference_check(ids, VOCAB)
        if bad is None:
            check_prompt_ids(ids, VOCAB, "input_ids")
            continue
        with pytest.raises(APIError) as e:
            check_prompt_ids(ids, VOCAB, "input_ids")
        assert e.value.status == 400 and e.value.param == "input_ids"
        assert str(e.value) == (f"input_ids: token id {bad} is outside the vocabulary [0, {VOCAB})")


def test_expand_without_images_returns_the_ids_unchanged() -> None:
    ids = [random.Random(1).randrange(VOCAB) for _ in range(4096)]
    image_token = VOCAB + 5  # not among the ids
    expanded, starts = expand_image_token_ids(ids, [], image_token)
    assert (expanded, starts) == (ids, []) and expanded is not ids
    expanded, starts = expand_image_token_ids([1, image_token, 2], [3], image_token)
    assert (expanded, starts) == ([1, image_token, image_token, image_token, 2], [1])


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_long_id_prompts_reach_the_scheduler_exactly(front, route: str) -> None:
    http, engine = front
    ids = [random.Random(7).randrange(VOCAB) for _ in range(4096)]
    ids[:3] = [0, VOCAB - 1, 0]
    body = {"input_ids": ids, "stream": True} if route == "/generate" else {"prompt": ids}
    engine.requests.clear()
    response = http.post(route, json={**body, "max_tokens": 1, "sampling_params": {}})
    assert response.status_code == 200, response.text
    (request,) = engine.requests
    assert request.input_ids == ids and all(type(t) is int for t in request.input_ids)


# (route, field, value) -> (status, message, param): today's answers, kept
REFUSALS = [
    ("input_ids", [1, VOCAB, -1], "input_ids: token id 1024 is outside the vocabulary [0, 1024)"),
    ("input_ids", [1, -1, VOCAB], "input_ids: token id -1 is outside the vocabulary [0, 1024)"),
    ("prompt", [4, 2**40], "prompt: token id 1099511627776 is outside the vocabulary [0, 1024)"),
    ("prompt", [-3], "prompt: token id -3 is outside the vocabulary [0, 1024)"),
]


@pytest.mark.parametrize(("field", "ids", "message"), REFUSALS)
def test_out_of_range_ids_are_refused_by_name(front, field: str, ids: list, message: str) -> None:
    http, engine = front
    route = "/generate" if field == "input_ids" else "/v1/completions"
    engine.requests.clear()
    response = http.post(route, json={field: [*range(100), *ids]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (message, field)
    assert engine.requests == []


@pytest.mark.parametrize("field", ["input_ids", "prompt"])
@pytest.mark.parametrize("bad", [1.5, "x", None, [1]])
def test_non_int_ids_are_refused(front, field: str, bad: Any) -> None:
    """pydantic's refusal (message and param are its own: input_ids.2 names the element)."""
    http, engine = front
    route = "/generate" if field == "input_ids" else "/v1/completions"
    engine.requests.clear()
    response = http.post(route, json={field: [1, 2, bad, 3]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in (field, f"{field}.2")
    assert engine.requests == []


@pytest.mark.parametrize("field", ["input_ids", "prompt"])
@pytest.mark.parametrize(("given", "sent"), [(True, 1), ("3", 3), (2.0, 2)])
def test_lax_ints_reach_the_scheduler_as_ints(front, field: str, given: Any, sent: int) -> None:
    """pydantic's lax mode takes these as ints, as it always has; the scheduler gets ints."""
    http, engine = front
    route = "/generate" if field == "input_ids" else "/v1/completions"
    engine.requests.clear()
    response = http.post(route, json={field: [1, 2, given, 3], "max_tokens": 1})
    assert response.status_code == 200, response.text
    (request,) = engine.requests
    assert request.input_ids == [1, 2, sent, 3]
    assert all(type(t) is int for t in request.input_ids)


def test_empty_id_prompts_are_refused(front) -> None:
    http, engine = front
    engine.requests.clear()
    answers = [
        (http.post("/generate", json={"input_ids": []}), "the prompt is empty"),
        (http.post("/v1/completions", json={"prompt": []}), "prompt: must not be empty"),
    ]
    for response, message in answers:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == message
    assert engine.requests == []
