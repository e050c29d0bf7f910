"The figures the book quotes from the original work: one file of citations, and the prose held to it."
import json
import re
from pathlib import Path

import pytest

from w4a4_book.records import citations

ROOT = Path(__file__).resolve().parent.parent


def _prose() -> list[tuple[str, str]]:
    "`(where, sentence)` for every sentence of the README and of every notebook's markdown cells."
    texts = [("README.md", (ROOT / "README.md").read_text())]
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts += [(nb.name, "".join(c["source"])) for c in cells if c["cell_type"] == "markdown"]
    return [(w, s) for w, t in texts for s in re.split(r"(?<=[.;:!?])\s+|\n\n", t) if s.strip()]


PROSE = _prose()
CITES = citations()
ORIGINAL = re.compile(r"original|article|write-up|Blackwell|B200|author", re.I)


def test_every_quote_holds_its_numbers():
    "Each citation names a known source, has a quote, and its numbers are written in the quote (checked by the loader)."
    assert len(CITES) >= 8
    for c in CITES.values():
        assert c["quote"] and c["source_title"]


def test_the_fix_gain_is_198_everywhere():
    "+198 % is the one fix gain the write-ups give; no sentence writes another three-digit gain, or 198 as anything else."
    assert CITES["fix_gain"]["values"] == [198] == CITES["fix_gain_zh"]["values"]
    seen = 0
    for where, s in PROSE:
        for m in re.finditer(r"\+(\d{3})\s?%", s):
            assert m.group(1) == "198", (where, s[:200])
        for m in re.finditer(r"(?<![\d.,])198(?![\d,])(\s?%)?", s):
            assert m.group(1), (where, s[:200])        # 198 is always a percentage
            seen += 1
    assert seen >= 3


def test_commit_speedup_is_computed_from_its_table():
    "The commit's own 2.2–2.4×: the ratio of its two quoted rows, v2+C1 over v1, both 2-CTA."
    ratios = [CITES[k]["values"][0] / CITES[k]["values"][1] for k in ("commit_small_k", "commit_r32")]
    want = f"{min(ratios):.1f}–{max(ratios):.1f}"
    hits = [(w, s) for w, s in PROSE if re.search(r"\d\.\d\s?[–-]\s?\d\.\d\s?×", s) and "c1d209c" in s]
    assert hits
    for where, s in hits:
        for m in re.finditer(r"(\d\.\d)\s?[–-]\s?(\d\.\d)\s?×", s):
            assert f"{m.group(1)}–{m.group(2)}" == want, (where, s[:200])


def test_quoted_mfu_figures_are_cited():
    "Every 'N % MFU' or 'N% of peak' in a sentence about the original work is one of the cited MFU figures."
    cited = {float(v) for c in CITES.values() if "MFU" in c["unit"] for v in c["values"]}
    checked = 0
    for where, s in PROSE:
        if not ORIGINAL.search(s):
            continue
        for m in re.finditer(r"(\d+(?:\.\d+)?)\s?%\s?(?:MFU|of peak)", s):
            assert float(m.group(1)) in cited, (where, m.group(0), s[:200])
            checked += 1
    assert checked >= 2


def test_the_ceiling_is_the_cited_range():
    "The 45–63 % MFU ceiling of a pure 2-CTA block-scaled GEMM, wherever the book writes it."
    lo, hi = CITES["ceiling_mfu"]["values"]
    for where, s in PROSE:
        for m in re.finditer(r"(\d+)\s?%?\s?(?:[–-]|to)\s?(\d+)\s?%\s?MFU", s):
            if ORIGINAL.search(s) or "ceiling" in s:
                assert (int(m.group(1)), int(m.group(2))) in {(lo, hi), (27, 28)}, (where, s[:200])


def test_which_block_the_fix_halved():
    "The write-up says LU; the commit says LA: the book's up-front finding rests on these two quotes."
    assert "up-projection" in CITES["fix_block_en"]["quote"] and "LA shape" in CITES["fix_block_commit"]["quote"]
    assert CITES["fix_block_commit"]["values"] == [32]
    assert any("activation" in s and "c1d209c" in s for w, s in PROSE if w == "README.md")


def test_loader_rejects_a_quote_without_its_number(tmp_path, monkeypatch):
    from w4a4_book import records
    (tmp_path / "data").mkdir()
    bad = {"sources": {"a": "A"}, "figures": [{"id": "x", "values": [27], "unit": "%", "source": "a", "quote": "about 26%"}]}
    (tmp_path / "citations.json").write_text(json.dumps(bad))
    monkeypatch.setattr(records, "data_dir", lambda: tmp_path / "data")
    with pytest.raises(ValueError, match=r"citation x: \[27\] not in its quote"):
        records.citations()
