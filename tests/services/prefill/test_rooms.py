"""Which pages a prefill room sends after each chunk (torch-free)."""

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.request import Request
from tandem.services.prefill.rooms import BootstrapInfo, PrefillRoom


def room_for(prompt_len: int, pages: list[int], dst: list[int], decode_prefix: int) -> PrefillRoom:
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=1))
    req.pages = pages
    return PrefillRoom(7, req=req, info=BootstrapInfo("d", dst, decode_prefix))


def test_sends_full_pages_per_chunk_and_the_partial_last_page_at_the_end():
    room = room_for(10, [40, 41, 42], [7, 8, 9], 0)  # page size 4: pages of 4, 4, 2 tokens
    assert room.pages_to_send(4, num_computed=5, final=False) == ([40], [7])
    assert room.pages_to_send(4, num_computed=7, final=False) == ([], [])
    assert room.pages_to_send(4, num_computed=10, final=True) == ([41, 42], [8, 9])
    assert room.pages_to_send(4, num_computed=10, final=True) == ([], [])


def test_skips_what_the_decode_worker_already_holds():
    room = room_for(13, [1, 2, 3, 4], [20, 21], 8)  # D has the first 2 pages cached
    assert room.pages_to_send(4, num_computed=4, final=False) == ([], [])
    assert room.pages_to_send(4, num_computed=12, final=False) == ([3], [20])
    assert room.pages_to_send(4, num_computed=13, final=True) == ([4], [21])


def test_prefill_cache_hit_pages_go_out_with_the_first_chunk():
    room = room_for(12, [5, 6, 7], [30, 31, 32], 0)
    # P's own prefix cache held 8 tokens: after the first chunk everything up to 12 is computed.
    assert room.pages_to_send(4, num_computed=12, final=True) == ([5, 6, 7], [30, 31, 32])
