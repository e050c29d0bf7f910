"The book: one config at the root, the sidebar in reading order, and a full render in which every written chapter appears."
import contextlib
import html
import io
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from w4a4_book.cli import drop_missing, render_book, sidebar_files

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT/"nbs"
PART_I = ["01_hopper", "02_formats", "03_reference", "04_v1", "05_v2", "06_budget", "07_lora_bug", "08_pipeline_depth", "09_pg",
          "10_blackwell", "11_lessons"]
PART_II = ["12_package", "13_gemm", "13a_operands", "13b_sm90_parts", "13c_pg_variants", "14_layer", "14a_ops", "15_quant", "16_accuracy",
           "17_block", "18_sm100_parts", "18a_sm100_v1", "18b_sm100_v2"]
APPENDIX = ["20_bench", "20a_timing", "20b_report", "20c_bench_layer", "20d_bench_block", "21_depth_model", "22_records",
            "23_cli", "24_running", "25_lab_notebook"]
CHAPTERS = ["index", *PART_I, *PART_II]
CONFIG = yaml.safe_load((ROOT/"_quarto.yml").read_text())


def test_root_config_is_the_only_book_config():
    skip = {".git", ".venv", "_proc", "_docs", "node_modules"}
    names = ("_quarto.yml", "_quarto.yaml", "_smalldocs.yml", "_smalldocs.yaml", "nbdev.yml", "sidebar.yml")
    found = [p for p in ROOT.rglob("*") if p.name in names and not skip & set(p.relative_to(ROOT).parts)]
    for p in found:
        assert p.resolve() == (ROOT/"_quarto.yml").resolve(), f"{p.relative_to(ROOT)} is a second book config"
    assert (NBS/"_quarto.yml").is_symlink() and (NBS/"_quarto.yml").resolve() == (ROOT/"_quarto.yml").resolve()
    assert "metadata-files" not in CONFIG


def test_sidebar_in_reading_order():
    assert sidebar_files(CONFIG) == [f"{c}.ipynb" for c in CHAPTERS + APPENDIX]
    contents = CONFIG["website"]["sidebar"]["contents"]
    assert contents[0] == {"href": "index.ipynb", "text": "Introduction"}
    assert [c.get("section") for c in contents[1:]] == ["Part I: the story", "Part II: the library", "Appendices"]
    assert [c["contents"] for c in contents[1:]] == [[f"{c}.ipynb" for c in part] for part in (PART_I, PART_II, APPENDIX)]


def test_chapter_numbers_follow_the_sidebar():
    "No two chapters share a number, and the numbers rise in reading order."
    import re as _re
    keys = [_re.match(r"(\d+)([a-z]?)_", c).groups() for c in PART_I + PART_II + APPENDIX]
    keys = [(int(n), letter) for n, letter in keys]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert CONFIG["project"]["type"] == "website"


def test_missing_chapters_are_left_out_not_broken(tmp_path):
    (tmp_path/"index.ipynb").touch()
    kept, missing = drop_missing(CONFIG, tmp_path)
    assert sidebar_files(kept) == ["index.ipynb"]
    assert len(missing) == len(CHAPTERS) + len(APPENDIX) - 1


def test_help_is_fast_and_light():
    out = subprocess.run(["w4a4-book", "--help"], capture_output=True, text=True, check=True).stdout
    assert "render" in out


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    "The whole book, rendered once into a scratch folder; with what the build printed."
    d = tmp_path_factory.mktemp("book")
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        dest = render_book(ROOT, dest=d/"site", proc=d/"proc", quiet=True)
    return dest, d/"proc", log.getvalue()


def written():
    return [f for f in sidebar_files(CONFIG) if (NBS/f).is_file()]


def test_every_written_chapter_renders(book):
    dest, _, _ = book
    assert "index.ipynb" in written()
    for f in written():
        page = dest/Path(f).with_suffix(".html")
        assert page.is_file(), f"{f} did not render"
        nb = json.loads((NBS/f).read_text())
        first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        title = re.sub(r"[`*]", "", re.match(r"#\s+(.+)", first).group(1)).strip()
        assert f"<title>{title}" in html.unescape(page.read_text()), f"{f}: title {title!r} missing"
    assert (dest/"search.json").is_file() and (dest/"site_libs").is_dir()


def test_sidebar_links_every_written_chapter_in_order(book):
    dest, _, _ = book
    index = (dest/"index.html").read_text()
    sidebar = index[index.index('id="quarto-sidebar"'):]
    order = [str(Path(f).with_suffix(".html")) for f in written()]
    assert [h for h in dict.fromkeys(re.findall(r'href="([\w.]+\.html)"', sidebar)) if h in order] == order


def test_build_warns_only_about_chapters_not_written_yet(book):
    _, _, log = book
    missing = set(sidebar_files(CONFIG)) - set(written())
    for line in log.splitlines():
        if "warning" in line and "broken link" in line:
            assert any(m in line for m in missing), line


def test_outputs_survive(book):
    "Every stored PNG of a page is in its HTML, and Markdown tables become tables."
    dest, proc, _ = book
    for nb_path in proc.glob("*.ipynb"):
        nb = json.loads(nb_path.read_text())
        shown = [c for c in nb["cells"] if c["cell_type"] == "code"
                 and not re.search(r"^#\|\s*(output|include):\s*false", "".join(c["source"]), re.M)]
        pngs = sum("image/png" in o.get("data", {}) for c in shown for o in c.get("outputs", []))
        assert (dest/nb_path.with_suffix(".html").name).read_text().count("data:image/png") == pngs, nb_path.name
    records = (dest/"22_records.html").read_text()
    assert records.count("<table") >= 2


def test_api_entries_and_exported_code(book):
    dest, _, _ = book
    page = (dest/"22_records.html").read_text()
    assert re.search(r'<h3 id="save_record"[^>]*>save_record</h3>', page)
    assert 'href="22_records.html#provenance"' in page  # a name in backticks links to its entry, locally
    assert '<span class="kw">def</span> <span class="fu">save_record</span>' in page
    assert "default_exp" not in page and "#| export" not in page


def test_links_stay_local(book):
    dest, _, _ = book
    host = "w4a4-book.example.org"
    for page in dest.glob("*.html"):
        assert host not in page.read_text(), f"{page.name} links to {host}"


REMOTE = re.compile(r'<(?:script|link|img|iframe|source|video|audio)\b[^>]*\b(?:src|href)=["\']?(https?://[^"\'\s>]*)'
                    r'|url\(\s*["\']?(https?://[^)"\']*)')   # a tag that loads a URL, or CSS's url(...) and @import url(...)


def test_pages_load_nothing_from_the_network(book):
    "No page or stylesheet fetches a script, style, font or image from the network: links to GitHub are fine, a CDN is not."
    dest, _, _ = book
    for f in [*dest.rglob("*.html"), *dest.rglob("*.css")]:
        m = REMOTE.search(f.read_text(encoding="utf-8", errors="replace"))
        assert m is None, f"{f.relative_to(dest)} loads {m.group(1) or m.group(2)}"


def test_formulas_are_mathml(book):
    dest, _, _ = book
    for name in ("02_formats.html", "03_reference.html"):
        page = (dest/name).read_text()
        assert page.count("<math") >= 5 and 'display="block"' in page, name
        assert "katex" not in page.lower() and not re.search(r'class="math (inline|display)">\\[(\[]', page), name


def test_book_css_is_linked(book):
    "Every page links the book's stylesheet, which lets wide tables and long code lines scroll in their own box."
    dest, _, _ = book
    css = (dest/"book.css").read_text()
    assert "overflow-x: auto" in css and "white-space: pre" in css
    for page in dest.glob("*.html"):
        assert 'rel="stylesheet" href="book.css"' in page.read_text(), page.name
