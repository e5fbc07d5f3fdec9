import os
import subprocess
import sys

import pytest

from kvfetcher.keys import Namespace, chunk_keys, chunk_prefix, object_name, preset_of

NS = Namespace(model="m", dtype="float16")


def test_keys_chain_over_the_whole_prefix():
    a = list(range(1000))
    b = a[:600] + [7] * 400  # diverges inside chunk 2 (tokens 512..767)
    ka, kb = chunk_keys(NS, a, 256), chunk_keys(NS, b, 256)
    assert len(ka) == 3  # complete chunks only: the 232-token tail has no key
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2]
    # the same chunk of tokens after a different prefix is a different chunk
    assert chunk_keys(NS, a[256:512], 256)[0] != ka[1]
    assert len(set(ka)) == 3


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model="m2", dtype="float16"),
        Namespace(model="m", dtype="bfloat16"),
        Namespace(model="m", dtype="float16", layout_version=99),
        Namespace(model="m", dtype="float16", tp_rank=1),
        Namespace(model="m", dtype="float16", tenant="acme"),
    ],
)
def test_namespace_separates(other):
    toks = list(range(512))
    assert set(chunk_keys(NS, toks, 256)).isdisjoint(chunk_keys(other, toks, 256))


def test_keys_are_stable_across_processes():
    code = "from kvfetcher.keys import *; print(chunk_keys(Namespace('m', 'float16', tenant='t'), list(range(300)), 100))"
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"  # a hash seed other than ours
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True, text=True, check=True)
    assert out.stdout == str(chunk_keys(Namespace("m", "float16", tenant="t"), list(range(300)), 100)) + "\n"


def test_large_token_ids_and_bad_input():
    assert chunk_keys(NS, [2**40, 1], 2) != chunk_keys(NS, [0, 1], 2)
    assert chunk_keys(NS, [1, 2, 3], 4) == []
    with pytest.raises(ValueError):
        chunk_keys(NS, [1, 2], 0)
    with pytest.raises(ValueError):
        chunk_keys(NS, [[1, 2]], 1)


def test_object_names_group_representations():
    k = chunk_keys(NS, list(range(4)), 4)[0]
    assert object_name(k, "q8").startswith(chunk_prefix(k))
    assert preset_of(object_name(k, "q8")) == "q8"
    with pytest.raises(ValueError):
        preset_of("kv/ab/whatever.tmp")
