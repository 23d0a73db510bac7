"""The bench's speedup chart (memra_dist/bench/plot.py): series from the batching rows, drawn as SVG and PNG."""

import xml.etree.ElementTree as ET

from memra_dist.bench.plot import speedups, svg

NS = "{http://www.w3.org/2000/svg}"


def _rows():
    out = []
    for n, plain in ((1, 100.0), (4, 350.0), (16, 1200.0)):
        out += [{"drafter": "none", "concurrency": n, "spec_k": "fixed", "steady_tok_s": plain},
                {"drafter": "none", "concurrency": n, "spec_k": "fixed", "steady_tok_s": plain * 1.02},  # a 2nd recording
                {"drafter": "dflash-replay", "concurrency": n, "spec_k": "fixed", "steady_tok_s": plain * 2.0 / n ** 0.25},
                {"drafter": "dflash-replay", "concurrency": n, "spec_k": "auto", "steady_tok_s": plain * 1.9}]
    out.append({"drafter": "ngram", "concurrency": 64, "spec_k": "fixed", "steady_tok_s": 9.0})  # no plain at 64
    return out


def test_series_are_over_plain_at_the_same_concurrency_and_skip_rows_without_it():
    s = speedups(_rows())
    assert list(s) == ["dflash-replay fixed", "dflash-replay auto"]  # ngram at 64 had no plain row
    fixed = dict(s["dflash-replay fixed"])
    assert fixed[1] == round(2.0 / 1.01, 3) and fixed[16] == round(1.0 / 1.01, 3)  # over the plain rows' mean
    assert [n for n, _ in s["dflash-replay auto"]] == [1, 4, 16]


def test_the_svg_draws_one_polyline_per_series_with_a_point_per_concurrency_and_the_plain_line():
    s = speedups(_rows())
    root = ET.fromstring(svg(s))
    lines = [e for e in root.iter(f"{NS}polyline")]
    assert [e.get("data-name") for e in lines] == list(s)
    for e in lines:
        assert len(e.get("points").split()) == 3
    ys = [float(p.split(",")[1]) for p in lines[0].get("points").split()]
    assert ys[0] < ys[-1]  # fixed K falls with concurrency: its points go down the chart (SVG y grows downward)
    plain = [e for e in root.iter(f"{NS}line") if e.get("class") == "plain"]
    texts = {e.text for e in root.iter(f"{NS}text")}
    assert plain and {"1", "4", "16", "plain", "dflash-replay auto"} <= texts


def test_no_baseline_is_a_chart_that_says_so():
    assert "no rows with a plain baseline" in svg(speedups([{"drafter": "ngram", "concurrency": 2,
                                                              "steady_tok_s": 5.0}]))


def test_rows_at_several_acceptances_are_series_of_their_own():
    rows = [{"drafter": "none", "concurrency": 4, "steady_tok_s": 100.0}]
    rows += [{"drafter": "eagle3-replay", "concurrency": 4, "spec_k": "auto", "corrupt": c, "steady_tok_s": v}
             for c, v in ((0.2, 180.0), (1.0, 98.0))]
    assert speedups(rows) == {"eagle3-replay auto corrupt 0.2": [(4, 1.8)], "eagle3-replay auto corrupt 1": [(4, 0.98)]}


def _has_color(img, hex_color: str) -> bool:
    """Any pixel of the RGB(A) image within a small distance of the color."""
    import numpy as np

    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(img[..., :3] - rgb).max(axis=-1) < 0.02).any())


def test_the_png_draws_each_series_in_its_color(tmp_path):
    import matplotlib.image as mpimg

    from memra_dist.bench.plot import COLORS, png

    s = speedups(_rows())
    png(s, tmp_path / "a.png")
    img = mpimg.imread(tmp_path / "a.png")
    assert img.shape[:2] == (500, 800)
    assert _has_color(img, COLORS[0]) and _has_color(img, COLORS[1])  # the two series
    assert not _has_color(img, COLORS[2])  # no third series drawn


def test_the_png_command_draws_a_bench_json_beside_it_and_refuses_other_files(tmp_path, capsys):
    import json

    from memra_dist.bench.plot import main

    rows = _rows()
    (tmp_path / "batching.json").write_text(json.dumps({"shape": "tiny", "device": "cpu", "rows": rows[:6]}))
    (tmp_path / "more.json").write_text(json.dumps({"shape": "tiny", "device": "cpu", "rows": rows[6:]}))
    assert main([str(tmp_path / "batching.json")]) == 0
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "batching.json"), str(tmp_path / "more.json"), "-o", str(tmp_path / "both.png")]) == 0
    import matplotlib.image as mpimg

    from memra_dist.bench.plot import COLORS

    assert _has_color(mpimg.imread(tmp_path / "both.png"), COLORS[1])  # the auto series: its rows in both files
    bench = {"meta": {"shape": "8b", "device_name": "GPU"}, "batching": {"sweep": {"rows": rows}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))  # `memra-dist bench`'s JSON: the section's sweep
    assert main([str(tmp_path / "bench.json"), "-o", str(tmp_path / "b.png")]) == 0
    assert _has_color(mpimg.imread(tmp_path / "b.png"), COLORS[1])
    (tmp_path / "other.json").write_text("[1, 2]")
    assert main([str(tmp_path / "other.json"), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and not (tmp_path / "o.png").exists()
