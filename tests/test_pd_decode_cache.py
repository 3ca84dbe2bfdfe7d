"""PD decode's prefix cache (--disaggregation-decode-enable-radix-cache): decode matches a
prompt in its own tree of KV pages, tells prefill decode_prefix_len, and prefill ships only the
pages past it (plus the state rows and aux row, always)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from workers.messages import Destination, decode, encode
from workers.rank_transfer import Ship
from workers.shipping import Room, Shipping

PAGE = 16


def shipping() -> Shipping:
    s = Shipping.__new__(Shipping)
    s.pool = SimpleNamespace(plan=SimpleNamespace(page_size=PAGE))
    s.peers = {"decode:1": None}
    s.to_ship, s.orders, s.jobs, s.job_ids, s.world = [], [], {}, itertools.count(1), 1
    s._write_aux = lambda req, room: None
    return s


def room(n: int, held: int, max_new_tokens: int = 4) -> Room:
    request = SimpleNamespace(
        input_ids=list(range(n)),
        sampling=SimpleNamespace(max_new_tokens=max_new_tokens),
        bootstrap_room=7,
    )
    pages = -(-n // PAGE)
    r = Room(request, deadline=0.0)
    r.dest = Destination(7, "s", "decode:1", list(range(100, 100 + pages)), 3, n, held)
    r.req = SimpleNamespace(pages=list(range(pages)), row=5)
    return r


def test_destination_carries_decode_prefix_len_and_defaults_to_none_held():
    msg = Destination(1, "s", "d:1", [4, 5, 6], 2, 40, 32)
    assert decode(encode(msg)) == msg
    old = b'{"kind":"dest","room":1,"session":"s","decode_addr":"d:1","pages":[4],"row":2,'
    assert decode(old + b'"prompt_len":3}').decode_prefix_len == 0


def test_prefill_ships_only_the_pages_past_decodes_prefix():
    s, r = shipping(), room(70, 32)  # 5 pages, decode holds 2
    assert s.destination_problem(r, r.dest) is None
    r.computed = 48  # a chunk ended at 3 whole pages: only page 2 is new
    s.record(7, final=False)
    s.record(7, final=True)
    s.order({7: r})
    first, last = s.orders
    assert isinstance(first, Ship) and (first.src_pages, first.dst_pages) == ([2], [102])
    assert first.rows is None
    assert (last.src_pages, last.dst_pages, last.rows) == ([3, 4], [103, 104], (5, 3))


def test_a_prompt_held_whole_by_decode_ships_only_its_rows():
    s, r = shipping(), room(64, 64)
    assert s.destination_problem(r, r.dest) is None
    r.computed = 48
    s.record(7, final=False)  # nothing new: no order
    s.record(7, final=True)
    s.order({7: r})
    (last,) = s.orders
    assert (last.src_pages, last.dst_pages, last.rows) == ([], [], (5, 3))


def test_decode_prefix_len_off_the_pages_is_refused():
    s = shipping()
    for held in (-16, 20, 80):
        r = room(70, held)
        assert "decode_prefix_len" in s.destination_problem(r, r.dest)
    r = room(70, 16, max_new_tokens=0)  # scoring-only: no memory at decode, nothing held
    r.dest = Destination(7, "s", "decode:1", [], -1, 70, 16)
    assert s.destination_problem(r, r.dest) is not None
