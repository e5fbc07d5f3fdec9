"""The sidecar's index of the store: runs from memory, absences that expire, a bound."""

from kvfetcher.store.index import StoredIndex


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_run_is_known_only_as_far_as_the_index_knows():
    idx = StoredIndex(negative_ttl_s=5.0, clock=Clock())
    assert idx.run(["a", "b"]) == ([], False)  # nothing known: the caller must list
    idx.stored("a", "raw", 10)
    idx.stored("a", "q8", 4)
    assert idx.run(["a", "b"]) == ([{"raw": 10, "q8": 4}], False)
    idx.listed(["b", "c"], [{"raw": 10}])  # b stored, c absent
    assert idx.run(["a", "b", "c", "d"]) == ([{"raw": 10, "q8": 4}, {"raw": 10}], True)
    assert idx.run(["a"]) == ([{"raw": 10, "q8": 4}], True)
    assert idx.run([]) == ([], True)


def test_an_absence_expires_so_another_sidecars_store_becomes_visible():
    clock = Clock()
    idx = StoredIndex(negative_ttl_s=5.0, clock=clock)
    idx.listed(["a"], [])
    assert idx.run(["a"]) == ([], True)
    clock.t += 5.01
    assert idx.run(["a"]) == ([], False)  # no longer trusted absent: listed again
    idx.stored("a", "raw", 1)  # a write of its own is known at once, absence or not
    assert idx.run(["a"]) == ([{"raw": 1}], True)


def test_forgotten_keys_and_the_bound():
    idx = StoredIndex(max_keys=2, clock=Clock())
    for k in "abc":
        idx.stored(k, "raw", 1)
    assert len(idx) == 2 and idx.run(["a"]) == ([], False)  # the least recently used went first
    idx.forget(["b", "zz"])
    assert idx.run(["b"]) == ([], False) and idx.run(["c"]) == ([{"raw": 1}], True)
