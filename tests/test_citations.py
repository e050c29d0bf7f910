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


def _paragraphs() -> list[tuple[str, str]]:
    "`(where, paragraph)` for every paragraph of the README and of every notebook's markdown cells."
    texts = [("README.md", (ROOT / "README.md").read_text())]
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        texts += [(nb.name, "".join(c["source"])) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown"]
    return [(w, p) for w, t in texts for p in re.split(r"\n\s*\n", t) if p.strip()]


PARAGRAPHS = _paragraphs()
SAME_CARD = f"{CITES['fix_ncu_same_card']['values'][0] / CITES['fix_ncu_same_card']['values'][1]:.2f}"


def test_three_digit_gains_are_cited():
    "The only three-digit gains the book writes are the cited cross-card ones: +198 % (blog, articles), +171 % (commit)."
    cited = {str(CITES[k]["values"][-1]) for k in ("fix_gain_blog", "lu_fix_gain_commit")} | {"198"}
    assert cited == {"198", "171"} and CITES["fix_gain"]["values"] == [198] == CITES["fix_gain_zh"]["values"]
    for where, s in PROSE:
        for m in re.finditer(r"\+(\d{3})\s?%", s):
            assert m.group(1) in cited, (where, s[:200])
        for m in re.finditer(r"(?<![\d.,])198(?![\d,])(\s?%)?", s):
            assert m.group(1), (where, s[:200])        # 198 is always a percentage


def test_every_198_says_what_it_compares():
    "+198 % compares two cards: wherever it is written, the same paragraph names the cards and gives the same-card factor."
    assert SAME_CARD == "1.45"
    seen = 0
    for where, p in PARAGRAPHS:
        if re.search(r"(?<![\d.,])198\s?%", p):
            seen += 1
            assert "B300" in p and "B200" in p and f"{SAME_CARD}×" in p, (where, p[:300])
    assert seen >= 3


def test_the_two_fixes_in_order():
    "The articles say LU; c1d209c halved LA first, 7296e90 LU second: the quotes, and the README tells both in that order."
    assert "up-projection" in CITES["fix_block_en"]["quote"] and "LA shape" in CITES["fix_block_commit"]["quote"]
    assert CITES["fix_block_commit"]["source"] == "commit-c1d209c" and CITES["lu_fix_clamp"]["source"] == "commit-7296e90"
    assert CITES["lu_fix_clamp"]["values"] == [4, 2]
    readme = (ROOT / "README.md").read_text()
    assert readme.index("activation block") < readme.index("up-projection block") and f"{SAME_CARD}×" in readme


BANNED = ("own finding", "differs in one detail", "second LoRA stage is the better suspect", "articles are wrong",
          "halves the LoRA *activation*", "the fix commit (`c1d209c`)")


def test_no_prose_says_the_articles_are_wrong():
    "The book's earlier claim, that the articles named the wrong block, is withdrawn everywhere."
    for where, s in PROSE:
        for phrase in BANNED:
            assert phrase not in s, (where, phrase, s[:200])


def test_sources_name_the_original_by_commit():
    doc = json.loads((ROOT / "nbs" / "citations.json").read_text())
    for name, src in doc["sources"].items():
        assert isinstance(src, dict) and src["title"], name
        if "repo" in src:
            assert src["repo"] == "ultism/svdquant-kernels" and re.fullmatch(r"[0-9a-f]{40}", src["commit"]), name
        else:
            assert src["file"].endswith(".txt"), name


def test_commit_speedup_is_computed_from_its_table():
    "The first fix's own 2.2–2.4×, wherever the book writes it: the ratio of its two quoted rows, v2+C1 over v1, both 2-CTA."
    ratios = [CITES[k]["values"][0] / CITES[k]["values"][1] for k in ("commit_small_k", "commit_r32")]
    want = f"{min(ratios):.1f}–{max(ratios):.1f}"
    for where, s in PROSE:
        if "c1d209c" not in s and "first fix" not in s: continue
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


def test_loader_rejects_a_quote_without_its_number(tmp_path, monkeypatch):
    from w4a4_book import records
    (tmp_path / "data").mkdir()
    bad = {"sources": {"a": "A"}, "figures": [{"id": "x", "values": [27], "unit": "%", "source": "a", "quote": "about 26%"}]}
    (tmp_path / "citations.json").write_text(json.dumps(bad))
    monkeypatch.setattr(records, "data_dir", lambda: tmp_path / "data")
    with pytest.raises(ValueError, match=r"citation x: \[27\] not in its quote"):
        records.citations()
