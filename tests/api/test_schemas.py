"""The HTTP API's schema: requests are checked field by field, messages survive JSON, and
docs/api.md is what the schema renders."""

import json
from pathlib import Path

import pytest

from kvfetcher.api import schemas
from kvfetcher.errors import RequestError
from kvfetcher.fetch.plan import FetchPlan, LoadDecision, LoadReply
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.kvbuffer import PagedLayout

ROOT = Path(__file__).resolve().parents[2]

PLAN = FetchPlan("m", "float16", 0, 64, 128, "ab" * 32, 128, "q8", (("q8", 1000), ("q8", 990)), 0.25,
                 {"q8": 0.25, "recompute": 1.5}, 0.01, None, None, "t")


def test_docs_api_md_is_what_the_schema_renders():
    assert (ROOT / "docs" / "api.md").read_text() == schemas.render(), "run: python -m kvfetcher.api.schemas > docs/api.md"


def test_messages_survive_json():
    for msg in (PLAN, LoadReply(128, 64, 64, (64, 128), "corrupt", "corrupt", "crc", LoadDecision("q8", 2, 0.25, {"q8": 0.25}, 0.3)),
                schemas.FetchRequest("b", [1, 2], PLAN, slots=[3, 4]), schemas.LookupRequest([1], prefill_model=PrefillModel(0.01, 1e-4, 2e-9)),
                schemas.StoreRequest("b", [1, 2], block_ids=[7, 3]),
                schemas.RegisterRequest(handles=[{"kind": "cuda"}] * 2, model="m", paged=PagedLayout("BHT(KD)", 16))):
        assert schemas.from_json(type(msg), json.loads(json.dumps(schemas.to_json(msg)))) == msg


@pytest.mark.parametrize(
    "cls, body, detail",
    [
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1, True]}, "'tokens[1]' must be integer"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "offset": 1.5}, "'offset' must be integer"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "deadline_s": "2s"}, "'deadline_s' must be number or null"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "plan": {**schemas.to_json(PLAN), "chunks": [["q8"]]}},
         "'plan.chunks[0]' must be [string, integer]"),
        (schemas.FetchRequest, {"tokens": [1]}, "'buffer' is required"),
        (schemas.LookupRequest, {"tokens": [1], "buffers": "b"}, "unknown field(s) ['buffers']"),
        (schemas.RegisterRequest, [1], "'body' must be an object"),
        (schemas.RegisterRequest, {"model": "m", "handles": [{}], "paged": {"dims": "BHT(KX)", "block_size": 16}}, "'paged': paged dims"),
        (schemas.RegisterRequest, {"model": "m", "handles": [{}], "paged": {"dims": "BHT(KD)", "block_size": 16.0}},
         "'paged.block_size' must be integer"),
        (schemas.RegisterRequest, {"model": "m", "handles": {}, "paged": {"dims": "BHT(KD)", "block_size": 16}},
         "'handles' must be [object, ...] or null"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "block_ids": [3, -1]}, "'block_ids[1]' must be >= 0"),
        (schemas.LookupRequest, {"tokens": [1], "prefill_model": {"c1": 1e-4, "c2": -1e-9}}, "'prefill_model.c2' must be >= 0"),
        (schemas.LookupRequest, {"tokens": [1], "prefill_model": {}}, "not all zero"),
    ],
)
def test_a_request_that_does_not_fit_is_refused_by_field(cls, body, detail):
    with pytest.raises(RequestError) as e:
        schemas.from_json(cls, body)
    assert detail in str(e.value)


def test_a_reply_may_carry_fields_a_client_does_not_know():
    assert schemas.from_json(schemas.StoreReply, {"queued_chunks": 1, "dropped": False, "new": 1}, strict=False) == schemas.StoreReply(1, False)


def test_numbers_are_floats_where_the_schema_says_so():
    r = schemas.from_json(schemas.LookupRequest, {"tokens": [1], "recompute_tokens_per_s": 5})
    assert isinstance(r.recompute_tokens_per_s, float)


def test_a_registration_names_one_handle():
    h, layout = {"kind": "cuda", "args": 1}, PagedLayout("BLTH(KD)", 16)
    assert schemas.RegisterRequest(handle=h, model="m").buffer_handle() == h
    paged = {"kind": "paged", "dims": "BLTH(KD)", "block_size": 16, "handles": [h]}
    assert schemas.RegisterRequest(handle=h, model="m", paged=layout).buffer_handle() == paged
    assert schemas.RegisterRequest(handles=[h, h], model="m", paged=layout).buffer_handle() == dict(paged, handles=[h, h])
    for bad in ({}, {"handle": h, "handles": [h]}, {"handles": [h]}):
        with pytest.raises(RequestError):
            schemas.RegisterRequest(model="m", **bad).buffer_handle()
