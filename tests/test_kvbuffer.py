"""kvbuffer: which slots of a KV buffer a request's tokens go to."""

import pytest

from kvfetcher.kvbuffer import contiguous, slot_list


def test_slot_lists_check_the_buffer_and_stay_cheap_when_contiguous():
    assert slot_list(100, 10, offset=90) == range(90, 100)
    assert contiguous(slot_list(100, 10, offset=90))
    assert slot_list(100, 3, slots=[5, 2, 7, 9]) == [5, 2, 7]
    assert not contiguous([5, 2, 7])
    assert contiguous([4, 5, 6])
    for kw in ({"offset": 91}, {"offset": -1}, {"slots": [1, 2]}, {"slots": list(range(9)) + [100]}, {"slots": [1] * 10}):
        with pytest.raises(ValueError):
            slot_list(100, 10, **kw)
