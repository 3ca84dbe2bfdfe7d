"""training/corpus.py's pieces that need no download: near-duplicate removal keeps a
held-out copy over its training twins, HTML loses its navigation, dictd entries are cut by their
index, and the held-out split of the first corpus's ids is unchanged."""

from __future__ import annotations

from training.corpus import is_heldout
from training.corpus_dedup import near_duplicates
from training.corpus_text import dict_entries, html_to_text

PROSE = " ".join(f"word{i} means something different from word{i + 1} in this text" for i in
                 range(60))  # fmt: skip


def test_near_duplicates_keep_the_preferred_copy_and_distinct_texts():
    other = " ".join(f"token{i} is unrelated to anything said before {i * 7}" for i in range(60))
    texts = [PROSE, PROSE + " one more line", other, PROSE.replace("word3 ", "w3 ")]
    assert near_duplicates(texts, [False, True, False, False]) == {0, 3}
    assert near_duplicates(texts, [False] * 4) == {1, 3}
    assert near_duplicates([PROSE, other], [False, False]) == set()


def test_html_navigation_is_left_out():
    page = ('<html><head><title>T</title></head><body><div class="navheader">Prev Next</div>'
            '<div class="body"><h1>Title</h1><p>Real text &amp; more.</p>'
            '<div class="sphinxsidebar"><div>Search</div><p>nav</p></div><p>After.</p></div>'
            '<footer>(c) someone</footer></body></html>')  # fmt: skip
    assert html_to_text(page) == "Title\n\nReal text & more.\n\nAfter."


def test_dict_entries_follow_the_index():
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n: int) -> str:  # dictd's own base-64 numbers, not RFC 4648
        return alphabet[n // 64] + alphabet[n % 64] if n >= 64 else alphabet[n]

    data = b"HEADER\nalpha\n  the first\nbeta\n  the second\n"
    index = "\n".join([f"00-database-info\t{b64(0)}\t{b64(7)}",
                       f"alpha\t{b64(7)}\t{b64(18)}", f"beta\t{b64(25)}\t{b64(18)}",
                       f"alias\t{b64(7)}\t{b64(18)}"])  # fmt: skip
    assert list(dict_entries(index, data)) == ["alpha\n  the first", "beta\n  the second"]


def test_heldout_split_of_the_first_corpus_is_unchanged():
    """tests/data/small_heldout.txt comes from this held-out page of the Python tutorial."""
    assert is_heldout("tutorial/introduction")
    assert not is_heldout("library/os")
