"""The session's rates: decode tok/s from the first token to the last, and the time to that
first token apart (a slow prefill or start-up must not read as a slow decode)."""

from __future__ import annotations

from memra_dist.specdec.session import SessionStats


def test_decode_rate_excludes_the_time_to_the_first_token():
    st = SessionStats(tokens=101, t_start=100.0, t_first=110.0, t_end=112.0)
    d = st.as_dict()
    assert d["ttft_ms"] == 10000.0
    assert d["tok_per_s"] == 50.0  # 100 tokens after the first in 2 s, not 101 in 12 s
    assert d["seconds"] == 12.0


def test_the_fast_path_label_names_what_ran():
    from memra_dist.phase.lines import fast_path_label

    assert fast_path_label({"graphs": True, "compile": True, "kernels": True}) == "graphs+compile+kernels"
    assert fast_path_label({"graphs": True, "compile": False, "kernels": False}) == "graphs"
    assert fast_path_label({"graphs": True, "compile": True, "kernels": True, "ahead": True}) == \
        "graphs+compile+kernels+ahead"
    assert fast_path_label({"graphs": False, "compile": False, "kernels": False}) == "eager"
    assert fast_path_label(None) == "eager"  # a result without the field (an older JSON)


def test_a_single_token_has_no_decode_rate():
    d = SessionStats(tokens=1, t_start=1.0, t_first=2.0, t_end=2.0).as_dict()
    assert d["tok_per_s"] == 0.0 and d["ttft_ms"] == 1000.0
