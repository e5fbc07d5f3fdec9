"""The HTTP API's schema: requests are checked field by field, messages survive JSON, and
docs/api.md is what the schema renders."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvfetcher.api import schemas
from kvfetcher.errors import RequestError
from kvfetcher.fetch.plan import FetchOptions, FetchPlan, FetchDecision, FetchReply
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.kvbuffer import PagedLayout

ROOT = Path(__file__).resolve().parents[2]

PLAN = FetchPlan("m", "float16", 0, 64, 128, "ab" * 32, 128, "q8", (("q8", 1000), ("q8", 990)), 0.25,
                 {"q8": 0.25, "recompute": 1.5}, 0.01, None, None, 1.9, "t")


def test_docs_api_md_is_what_the_schema_renders():
    assert (ROOT / "docs" / "api.md").read_text() == schemas.render(), "run: python -m kvfetcher.api.schemas > docs/api.md"


def _plain(msg):
    """``msg`` with its token ids (a numpy array once parsed) as a list, comparable with ``==``."""
    return dataclasses.replace(msg, tokens=[int(t) for t in msg.tokens]) if hasattr(msg, "tokens") else msg


def test_messages_survive_json():
    options = FetchOptions(presets=("q8",), prefill_model=PrefillModel(0.01, 1e-4, 2e-9), refresh=True)
    for msg in (PLAN, FetchReply(128, 64, 64, (64, 128), "corrupt", "corrupt", "crc", FetchDecision("q8", 2, 0.25, {"q8": 0.25}, 0.3)),
                schemas.FetchRequest("b", [1, 2], PLAN, slots=[3, 4]), schemas.LookupRequest([1], options=options),
                schemas.StoreRequest("b", [1, 2], block_ids=[7, 3]),
                schemas.RegisterRequest(handles=[{"kind": "cuda"}] * 2, model="m", paged=PagedLayout("BHT(KD)", 16))):
        assert _plain(schemas.from_json(type(msg), json.loads(json.dumps(schemas.to_json(msg))))) == msg


def test_token_ids_travel_packed_or_as_an_array():
    ids = [0, 7, 2**32 - 1, 128_000]
    packed = schemas.TokenIds.pack(ids)
    for wire in (packed, ids):
        got = schemas.from_json(schemas.LookupRequest, {"tokens": wire}).tokens
        assert got.dtype == np.int64 and got.tolist() == ids
    for bad, detail in (("###", "base64"), ("AAA=", "whole number"), ([[1]], "int64"), ([1.5], "int64"), ("", None)):
        if detail is None:  # an empty prompt packs to an empty string
            assert schemas.from_json(schemas.LookupRequest, {"tokens": bad}).tokens.tolist() == []
            continue
        with pytest.raises(RequestError, match=detail):
            schemas.from_json(schemas.LookupRequest, {"tokens": bad})
    with pytest.raises(ValueError):
        schemas.TokenIds.pack([-1])


@pytest.mark.parametrize(
    "cls, body, detail",
    [
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1, True]}, "'tokens' must be an array of int64 integers"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "offset": 1.5}, "'offset' must be integer"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "options": {"deadline_s": "2s"}}, "'options.deadline_s' must be number or null"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "deadline_s": 2}, "unknown field(s) ['deadline_s']"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "plan": {**schemas.to_json(PLAN), "chunks": [["q8"]]}},
         "'plan.chunks[0]' must be [string, integer]"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "plan": {**schemas.to_json(PLAN), "chunks": [["q8", 5], ["raw", True]]}},
         "'plan.chunks[1][1]' must be integer"),  # checked in one pass; the element that fails is still named
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "plan": {**schemas.to_json(PLAN), "chunks": [["q8", 2**63]]}},
         "'plan.chunks[0][1]' must be integer"),
        (schemas.FetchRequest, {"tokens": [1]}, "'buffer' is required"),
        (schemas.LookupRequest, {"tokens": [1], "buffers": "b"}, "unknown field(s) ['buffers']"),
        (schemas.RegisterRequest, [1], "'body' must be an object"),
        (schemas.RegisterRequest, {"model": "m", "handles": [{}], "paged": {"dims": "BHT(KX)", "block_size": 16}}, "'paged': paged dims"),
        (schemas.RegisterRequest, {"model": "m", "handles": [{}], "paged": {"dims": "BHT(KD)", "block_size": 16.0}},
         "'paged.block_size' must be integer"),
        (schemas.RegisterRequest, {"model": "m", "handles": {}, "paged": {"dims": "BHT(KD)", "block_size": 16}},
         "'handles' must be [object, ...] or null"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "block_ids": [3, -1]}, "'block_ids[1]' must be >= 0"),
        (schemas.FetchRequest, {"buffer": "b", "tokens": [1], "block_ids": [3, 4, True]}, "'block_ids[2]' must be integer"),
        (schemas.LookupRequest, {"tokens": [1], "options": {"prefill_model": {"c1": 1e-4, "c2": -1e-9}}},
         "'options.prefill_model.c2' must be >= 0"),
        (schemas.LookupRequest, {"tokens": [1], "options": {"prefill_model": {}}}, "not all zero"),
        (schemas.LookupRequest, {"tokens": [1], "options": {"group_size": 0}}, "'options.group_size' must be >= 1"),
        (schemas.LookupRequest, {"tokens": [1], "options": {"ttft_budget_s": 0}}, "'options.ttft_budget_s' must be > 0"),
        (schemas.LookupRequest, {"tokens": [1], "options": {"load_overhead_s": -0.01}}, "'options.load_overhead_s' must be >= 0"),
    ],
)
def test_a_request_that_does_not_fit_is_refused_by_field(cls, body, detail):
    with pytest.raises(RequestError) as e:
        schemas.from_json(cls, body)
    assert detail in str(e.value)


def test_an_array_of_scalar_pairs_parses_to_tuples_in_one_pass():
    plan = schemas.from_json(schemas.FetchRequest, {"buffer": "b", "tokens": [1], "plan": {**schemas.to_json(PLAN), "chunks": [["q8", 5], ["raw", 7]]}}).plan
    assert plan.chunks == (("q8", 5), ("raw", 7)) and all(type(c) is tuple for c in plan.chunks)
    assert schemas.from_json(schemas.FetchRequest, {"buffer": "b", "tokens": [1], "slots": [3, 4]}).slots == [3, 4]
    assert schemas.from_json(schemas.FetchRequest, {"buffer": "b", "tokens": [1], "block_ids": list(range(4096))}).block_ids == list(range(4096))


def test_a_reply_may_carry_fields_a_client_does_not_know():
    assert schemas.from_json(schemas.StoreReply, {"queued_chunks": 1, "dropped": False, "new": 1}, strict=False) == schemas.StoreReply(1, False)


def test_numbers_are_floats_where_the_schema_says_so():
    r = schemas.from_json(schemas.LookupRequest, {"tokens": [1], "options": {"recompute_tokens_per_s": 5}})
    assert isinstance(r.options.recompute_tokens_per_s, float)


def test_a_registration_names_one_handle():
    h, layout = {"kind": "cuda", "args": 1}, PagedLayout("BLTH(KD)", 16)
    assert schemas.RegisterRequest(handle=h, model="m").buffer_handle() == h
    paged = {"kind": "paged", "dims": "BLTH(KD)", "block_size": 16, "handles": [h]}
    assert schemas.RegisterRequest(handle=h, model="m", paged=layout).buffer_handle() == paged
    assert schemas.RegisterRequest(handles=[h, h], model="m", paged=layout).buffer_handle() == dict(paged, handles=[h, h])
    for bad in ({}, {"handle": h, "handles": [h]}, {"handles": [h]}):
        with pytest.raises(RequestError):
            schemas.RegisterRequest(model="m", **bad).buffer_handle()


def test_the_clients_request_body_is_the_json_of_the_message_with_packed_tokens_appended_as_they_are():
    from kvfetcher.api.client import _json_body

    packed = schemas.TokenIds.pack(list(range(1000, 1600)))
    for body in ({"tokens": packed, "model": "m", "options": {"wait_s": 0.005}}, {"tokens": packed}, {"tokens": [1, 2], "buffer": "b"},
                 {"tokens": 'a"b\\c'}, {"tokens": "é"}, {"buffer": "b"}):
        assert json.loads(_json_body(body)) == body  # what json.dumps would say, whichever way it was written
    assert _json_body({"tokens": packed, "buffer": "b"}).endswith(f'"tokens": "{packed}"}}'.encode())  # spliced, not re-encoded
