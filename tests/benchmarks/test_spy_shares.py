from benchmarks.lib.spy_shares import shares

RAW = [
    "thread (1): kvf-encode_0;loop (benchmarks/lib/timing.py:12);encode (kvfetcher/codec/nvcomp.py:178) 3\n",
    "thread (1): kvf-encode_0;loop (benchmarks/lib/timing.py:12);gather (kvfetcher/codec/runs_kernel.py:53) 1\n",
    "thread (2): MainThread;select (selectors.py:468) 6\n",
]


def test_shares_keep_the_stacks_within_and_count_functions_once_a_stack():
    kept, inclusive, own = shares(RAW, ["kvf-encode"])
    assert kept == 4
    assert inclusive["loop (timing.py)"] == 4 and inclusive["encode (nvcomp.py)"] == 3
    assert own == {"encode:178": 3, "gather:53": 1}
    assert shares(RAW, ["kvf-encode", "gather"])[0] == 1
    assert shares(RAW, [])[0] == 10
