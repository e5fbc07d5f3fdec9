"""kvbuffer: which slots of a KV buffer a request's tokens go to."""

import pytest

import torch

from kvfetcher.kvbuffer import PagedLayout, contiguous, read_blocks, slot_list, write_blocks


def test_slot_lists_check_the_buffer_and_stay_cheap_when_contiguous():
    assert slot_list(100, 10, offset=90) == range(90, 100)
    assert contiguous(slot_list(100, 10, offset=90))
    assert slot_list(100, 3, slots=[5, 2, 7, 9]) == [5, 2, 7]
    assert not contiguous([5, 2, 7])
    assert contiguous([4, 5, 6])
    for kw in ({"offset": 91}, {"offset": -1}, {"slots": [1, 2]}, {"slots": list(range(9)) + [100]}, {"slots": [1] * 10}):
        with pytest.raises(ValueError):
            slot_list(100, 10, **kw)


@pytest.mark.parametrize("dims", ["KBTHD", "BHKTD", "BTHKD", "LKBTHD", "BLTHKD"])
def test_paged_blocks_round_trip_in_any_axis_order(dims):
    L, H, D, bs, nb = 3, 2, 4, 8, 10
    sizes = dict(L=L, K=2, B=nb, T=bs, H=H, D=D)
    shape = [sizes[c] for c in dims]
    tensors = torch.zeros(shape) if "L" in dims else [torch.zeros(shape) for _ in range(L)]
    layout = PagedLayout(dims, bs)
    kv = torch.randn(L, 2, H, 3 * bs, D)
    block_ids = [7, 2, 9, 4]  # a prompt of 4 blocks; tokens 8..32 are written (its first block is someone else's)
    write_blocks(tensors, layout, block_ids, kv, first_token=bs)
    assert torch.equal(read_blocks(tensors, layout, block_ids, bs, 3 * bs), kv)
    assert torch.equal(read_blocks(tensors, layout, block_ids, 2 * bs, bs), kv[:, :, :, bs : 2 * bs])
    one = tensors if "L" in dims else tensors[1]
    untouched = [b for b in range(nb) if b not in (2, 9, 4)]
    assert not one.index_select(dims.index("B"), torch.tensor(untouched)).any()  # nothing else was written
    k_axis = [c for c in dims if c != "L"]  # token 8+j of layer 1, key, head 1 sits in block 2 at j
    t = tensors[1] if "L" not in dims else tensors.select(dims.index("L"), 1)
    at = dict(K=0, B=2, T=5, H=1)
    assert torch.equal(t[tuple(at.get(c, slice(None)) for c in k_axis)], kv[1, 0, 1, 5])


def test_paged_blocks_refuse_what_does_not_fit():
    layout = PagedLayout("KBTHD", 4)
    cache = [torch.zeros(2, 6, 4, 2, 3)]
    kv = torch.zeros(1, 2, 2, 8, 3)
    for ids, first, bad_kv in (([0, 9], 0, kv), ([0, 0, 1], 0, kv), ([0, 1], 4, kv), ([0, 1, 2], 2, kv),
                               ([0, 1, 2], 0, kv[:, :, :, :6]), ([0, 1], 0, torch.zeros(2, 2, 2, 8, 3))):
        with pytest.raises(ValueError):
            write_blocks(cache, layout, ids, bad_kv, first_token=first)
    for dims, bs in (("KBTH", 4), ("KBTHDD", 4), ("KBTHD", 0)):
        with pytest.raises(ValueError):
            PagedLayout(dims, bs)
    with pytest.raises(ValueError):  # block_size is not the T axis
        read_blocks(cache, PagedLayout("KBTHD", 2), [0, 1], 0, 4)
