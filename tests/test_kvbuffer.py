"""kvbuffer: which slots of a flat KV buffer, or which blocks of paged KV, a request's tokens go to."""

import math

import pytest
import torch

from kvfetcher.kvbuffer import PagedKV, PagedLayout, block_runs, contiguous, read_blocks, slot_list, write_blocks


def test_slot_lists_check_the_buffer_and_stay_cheap_when_contiguous():
    assert slot_list(100, 10, offset=90) == range(90, 100)
    assert contiguous(slot_list(100, 10, offset=90))
    assert slot_list(100, 3, slots=[5, 2, 7, 9]) == [5, 2, 7]
    assert not contiguous([5, 2, 7])
    assert contiguous([4, 5, 6])
    for kw in ({"offset": 91}, {"offset": -1}, {"slots": [1, 2]}, {"slots": list(range(9)) + [100]}, {"slots": [1] * 10}):
        with pytest.raises(ValueError):
            slot_list(100, 10, **kw)


# --- paged KV ---------------------------------------------------------------------------------

L, H, D, BS, NB = 3, 2, 4, 8, 10
#: every axis order a paged tensor may have: per layer and cross-layer, K/V apart or packed
DIMS = ["KBTHD", "KBHTD", "BHKTD", "BTHKD", "BHT(KD)", "BTH(KD)", "BH(KT)D", "HDKTB", "LKBTHD", "BLTH(KD)", "BHLT(KD)", "T(KD)HLB"]


def paged_tensors(dims: str, fill: float = 0.0, layers: int = L):
    """Tensors of ``dims`` (one holding every layer, or one per layer) filled with ``fill``."""
    size = dict(L=layers, K=2, B=NB, T=BS, H=H, D=D)
    shape = [math.prod(size[c] for c in axis) for axis in PagedLayout(dims, BS).axes]
    return torch.full(shape, fill) if "L" in dims else [torch.full(shape, fill) for _ in range(layers)]


def value_at(tensors, dims: str, layer: int, k: int, block: int, pos: int, head: int) -> torch.Tensor:
    """The head_dim values of (layer, k, head) at position ``pos`` of ``block``, read by index
    arithmetic on the tensor's own axes (independently of kvbuffer's views)."""
    size = dict(L=L, K=2, B=NB, T=BS, H=H, D=D)
    at = dict(L=layer, K=k, B=block, T=pos, H=head)
    t = tensors if "L" in dims else tensors[layer]
    out = []
    for d in range(D):
        at["D"] = d
        index = []
        for axis in PagedLayout(dims, BS).axes:
            i = 0
            for c in axis:
                i = i * size[c] + at[c]
            index.append(i)
        out.append(t[tuple(index)])
    return torch.stack(out)


@pytest.mark.parametrize("dims", DIMS)
def test_paged_blocks_round_trip_in_every_axis_order(dims):
    layout = PagedLayout(dims, BS)
    tensors = paged_tensors(dims, fill=-1.0)
    kv = torch.randn(L, 2, H, 4 * BS, D)  # the prompt's KV
    block_ids = [9, 3, 0, 7, 5]  # the prompt's 5 blocks, scattered and out of order
    write_blocks(tensors, layout, block_ids, kv[:, :, :, BS:], first_token=BS)  # tokens 8..32: blocks 3, 0, 7
    assert torch.equal(read_blocks(tensors, layout, block_ids, BS, 3 * BS), kv[:, :, :, BS:])
    assert torch.equal(read_blocks(tensors, layout, block_ids, 2 * BS, BS), kv[:, :, :, 2 * BS : 3 * BS])
    for layer, k, token, head in ((0, 0, BS, 0), (2, 1, 3 * BS + 5, 1), (1, 1, 2 * BS + 7, 0)):
        assert torch.equal(value_at(tensors, dims, layer, k, block_ids[token // BS], token % BS, head), kv[layer, k, head, token])
    untouched = [b for b in range(NB) if b not in (3, 0, 7)]
    kept = read_blocks(tensors, layout, untouched, 0, len(untouched) * BS)
    assert bool((kept == -1).all()), "a block outside the prompt's was written"


def test_paged_kv_writes_through_strided_views_as_vllm_hands_them_over():
    """vLLM's FlashAttention gives each layer a logical (blocks, heads, block_size, 2 * head_dim) view
    of NHD memory (blocks, block_size, heads, 2 * head_dim): written in place, keys then values."""
    physical = [torch.zeros(NB, BS, H, 2 * D) for _ in range(L)]
    logical = [p.permute(0, 2, 1, 3) for p in physical]
    kv = torch.randn(L, 2, H, 2 * BS, D)
    write_blocks(logical, PagedLayout("BHT(KD)", BS), [4, 1], kv)
    assert torch.equal(physical[2][1, 3, 1, :D], kv[2, 0, 1, BS + 3])  # token 11: block 1, position 3
    assert torch.equal(physical[2][1, 3, 1, D:], kv[2, 1, 1, BS + 3])
    cpu = [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]  # vLLM's CPU backend: per block and head, keys then values
    write_blocks([t.view(NB, H, 2, BS, D) for t in cpu], PagedLayout("BHKTD", BS), [4, 1], kv)
    keys, values = cpu[0].view(NB, H, 2 * BS, D).chunk(2, dim=2)
    assert torch.equal(values[1, 0, 3], kv[0, 1, 0, BS + 3]) and torch.equal(keys[4, 1, 0], kv[0, 0, 1, 0])


@pytest.mark.parametrize("dims", ["KBTH", "KBTHDD", "KKBTHD", "KBTHX", "(K)BTHD", "BHT(KD", "BHT(KDH)", "BT(HD)K", "", "bhtkd"])
def test_bad_paged_dims_are_refused(dims):
    with pytest.raises(ValueError, match="paged dims"):
        PagedLayout(dims, BS)


@pytest.mark.parametrize("block_size", [0, -16, True, 16.0])
def test_bad_block_sizes_are_refused(block_size):
    with pytest.raises(ValueError, match="block_size"):
        PagedLayout("BHT(KD)", block_size)


@pytest.mark.parametrize(
    "tensors, match",
    [
        ([torch.zeros(2, NB, BS, H)] * L, "axes"),  # one axis short
        ([torch.zeros(2, NB, BS + 1, H, D)] * L, "does not fit"),  # T is not block_size
        ([torch.zeros(3, NB, BS, H, D)] * L, "does not fit"),  # K has 3 entries
        ([torch.zeros(2, NB, BS, H, D)] * 2 + [torch.zeros(2, NB + 1, BS, H, D)], "differ"),
        ([torch.zeros(2, NB, BS, H, D)] * 2 + [torch.zeros(2, NB, BS, H, D, dtype=torch.float16)], "differ"),
        ([torch.zeros(2, NB, BS, H, D, dtype=torch.int32)] * L, "dtype"),
        ([], "at least one"),
    ],
)
def test_paged_tensors_that_do_not_fit_their_dims_are_refused(tensors, match):
    with pytest.raises(ValueError, match=match):
        PagedKV(tensors, PagedLayout("KBTHD", BS))


def test_one_cross_layer_tensor_only():
    with pytest.raises(ValueError, match="one tensor"):
        PagedKV([torch.zeros(L, 2, NB, BS, H, D)] * 2, PagedLayout("LKBTHD", BS))
    with pytest.raises(ValueError, match="does not fit"):  # (KD) of an odd size
        PagedKV([torch.zeros(NB, H, BS, 2 * D + 1)], PagedLayout("BHT(KD)", BS))


@pytest.mark.parametrize(
    "block_ids, first_token, tokens, match",
    [
        ([0, 1, NB], 0, 2 * BS, "out of range"),  # any id given is checked, used or not
        ([0, -1], 0, 2 * BS, "out of range"),
        ([2, 5, 2], 0, 2 * BS, "distinct"),
        ([2, 5], BS, 2 * BS, "block ids given"),  # too few
        ([2, 5, 6], 3, 2 * BS, "whole blocks"),
        ([2, 5, 6], 0, BS + 4, "whole blocks"),
    ],
)
def test_block_ids_and_token_ranges_that_do_not_fit_write_nothing(block_ids, first_token, tokens, match):
    tensors, layout = paged_tensors("KBHTD", fill=-1.0), PagedLayout("KBHTD", BS)
    with pytest.raises(ValueError, match=match):
        write_blocks(tensors, layout, block_ids, torch.randn(L, 2, H, tokens, D), first_token=first_token)
    with pytest.raises(ValueError, match=match):
        read_blocks(tensors, layout, block_ids, first_token, tokens)
    assert all(bool((t == -1).all()) for t in tensors)


@pytest.mark.parametrize("kv", [torch.zeros(L + 1, 2, H, BS, D), torch.zeros(L, 2, H + 1, BS, D), torch.zeros(L, 2, H, BS, D + 1),
                                torch.zeros(L, 2, H, BS, D, dtype=torch.float16), torch.zeros(L, 2, H, BS)])
def test_kv_of_another_geometry_or_dtype_is_refused(kv):
    tensors = paged_tensors("BHT(KD)", fill=-1.0)
    with pytest.raises(ValueError, match="does not fit"):
        write_blocks(tensors, PagedLayout("BHT(KD)", BS), [1], kv)
    assert all(bool((t == -1).all()) for t in tensors)

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dims", DIMS)
def test_a_copy_out_to_the_host_reads_what_the_device_gather_reads(dims, device):
    """read_into copies runs of whole blocks where blocks are the outer axis, else gathers: the same KV either way."""
    layout = PagedLayout(dims, BS)
    tensors = paged_tensors(dims)
    tensors = tensors.to(device) if "L" in dims else [t.to(device) for t in tensors]
    for t in [tensors] if "L" in dims else tensors:
        t.copy_(torch.randn(t.shape))
    paged = PagedKV(tensors, layout)
    for blocks in ([2, 3, 4, 9, 0, 1], [5], [9, 8, 7], list(range(NB))):
        out = torch.full((L, 2, H, len(blocks) * BS, D), float("nan"))
        paged.read_into(blocks, out[:, :, :, :])
        assert torch.equal(out, paged.read(blocks).cpu())
    wide = torch.zeros(L, 2, H, 5 * BS, D)
    paged.read_into([7, 8], wide[:, :, :, BS : 3 * BS])  # into a slice of a larger host tensor
    assert torch.equal(wide[:, :, :, BS : 3 * BS], paged.read([7, 8]).cpu()) and not wide[:, :, :, :BS].any() and not wide[:, :, :, 3 * BS :].any()


def test_block_runs_group_consecutive_ids_in_order():
    assert block_runs([2, 3, 4, 9, 0, 1, 5]) == [(0, 2, 3), (3, 9, 1), (4, 0, 2), (6, 5, 1)]
    assert block_runs([]) == [] and block_runs([7]) == [(0, 7, 1)] and block_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]


@pytest.mark.parametrize("piece_bytes", [1, 3000, 1 << 30])
def test_a_store_reads_the_same_kv_in_pieces_as_in_one(piece_bytes, monkeypatch):
    from kvfetcher import kvbuffer

    monkeypatch.setattr(kvbuffer, "READ_PIECE_BYTES", piece_bytes)
    L, H, D, T, bs = 2, 3, 4, 48, 8
    flat = torch.randn(L, 2, H, 64, D)
    slots = [(7 * i) % 64 for i in range(T)]  # scattered
    assert torch.equal(kvbuffer.destination(flat, T, slots=slots).read(8, 32), flat[:, :, :, slots[8:40]])
    assert torch.equal(kvbuffer.destination(flat, T, offset=5).read(0, T), flat[:, :, :, 5 : 5 + T])
    kv = torch.randn(L, 2, H, T, D)
    cross = torch.zeros(12, L, bs, H, 2 * D)
    block_ids = [9, 2, 7, 0, 5, 11]
    write_blocks(cross, PagedLayout("BLTH(KD)", bs), block_ids, kv)
    paged = kvbuffer.destination(PagedKV(cross, PagedLayout("BLTH(KD)", bs)), T, block_ids=block_ids, first_token=8)
    assert torch.equal(paged.read(8, 40), kv[:, :, :, 8:48])
    with pytest.raises(ValueError, match="first_token"):
        paged.read(0, 8)
