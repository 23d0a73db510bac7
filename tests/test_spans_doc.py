"""docs/spans.md is generated from the registry and the line printers: never stale, and it
names every span and attribute the registry holds."""

from memra_dist.tracing import conventions as C
from memra_dist.tracing.spans_doc import ATTR_DOC, DOC_PATH, render


def test_doc_is_fresh():
    assert DOC_PATH.read_text() == render(), "run: python -m memra_dist.tracing.spans_doc"


def test_every_registry_name_is_documented():
    text = render()
    names = [C.SPAN_REQUEST, C.SPAN_BURST, C.SPAN_ROUND, C.SPAN_FIRST_TOKEN, C.SPAN_PRIME_CHUNK, C.SPAN_STAGE_FORWARD,
             *C.PHASE_SPANS.values(), *C.VERIFY_SUB_SPANS.values(), *(C.ttft_span(b) for b in C.TTFT_BUCKETS),
             *C.ATTR.values(), *C.RESOURCE.values(), *(f"[{t}]" for t in C.TAGS.values())]
    missing = [n for n in names if f"`{n}`" not in text and n not in text]
    assert missing == []
    assert set(ATTR_DOC) == set(C.ATTR)  # every attribute has a unit and a meaning


def test_example_lines_are_the_printers_output():
    text = render()
    assert "[spec-phase] rounds=2 k=4 total=25.20ms | draft=4.10 verify=19.70" in text
    assert "vkda=4.100 (scan=1.200) vmla=2.300 vattn=0.000 vrest=3.450 (vffn=2.000)" in text
