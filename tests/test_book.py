"The book: one config at the root, the sidebar in reading order, and a full render in which every written chapter appears."
import ast
import contextlib
import html
import io
import itertools
import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from w4a4_book.cli import drop_missing, render_book, sidebar_files

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT/"nbs"
PART_I = ["01_hopper", "02_formats", "03_reference", "04_v1", "05_v2", "06_budget", "07_lora_bug", "08_pipeline_depth", "09_pg",
          "10_blackwell", "11_lessons"]
PART_II = ["12_package", "12a_configs", "13_gemm", "13a_operands", "13b_sm90_parts", "13c_pg_variants", "13d_registry", "13e_heuristics",
           "13f_jit", "13g_cache", "13h_ptx", "13i_barriers", "13j_scheduler", "13k_pg_decode",
           "14_layer", "14a_ops", "15_quant", "15a_act_quant", "16_accuracy",
           "17_block", "18_sm100_parts", "18a_sm100_v1", "18b_sm100_v2", "19_flux", "19a_nunchaku"]
APPENDIX = ["20_bench", "20a_timing", "20b_report", "20c_bench_layer", "20d_bench_block", "20e_bench_flux", "20f_bench_variants",
            "20g_probes", "20h_probe_clock", "20i_probe_decode",
            "20j_probe_host", "20k_probe_ncu", "20l_probe_main", "21_depth_model", "22_records",
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


# A GPU cell's directive names where its result is, and the build shows that in place of the output it cannot make.
GPU_LINE = re.compile(r"^#\|\s*gpu\b(.*)$", re.M)


def gpu_cells():
    "Every `#| gpu` cell of the book: (notebook, cell id, what follows `gpu` on its line)."
    out = []
    for f in sorted(NBS.glob("*.ipynb")):
        for c in json.loads(f.read_text())["cells"]:
            lines = "".join(c["source"]).splitlines()
            head = "\n".join(itertools.takewhile(lambda l: l.startswith("#|") or not l.strip(), lines))  # directives
            m = c["cell_type"] == "code" and GPU_LINE.search(head)
            if m:
                out.append((f.name, c.get("id"), m.group(1).strip()))
    return out


def test_gpu_cells_name_their_record_or_test():
    "Each GPU cell names records that `nbs/data/` holds, or says `check` with a test of `tests/` that exists."
    from w4a4_book.cli import gpu_directive
    cells = gpu_cells()
    assert len(cells) >= 14
    for nb, cid, text in cells:
        g = gpu_directive(text)
        assert g.records or g.test, f"{nb} cell {cid}: `#| gpu` names no record and says no `check`"
        for r in g.records:
            assert (NBS/"data"/r).is_file(), f"{nb} cell {cid} names {r}, which nbs/data/ does not hold"
        if g.test:
            path, name = g.test.split("::")
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", (ROOT/path).read_text(), re.M), \
                f"{nb} cell {cid}: {g.test} is not a test"
            assert g.checks.startswith("that "), f"{nb} cell {cid}: say what it checks, 'that ...'"


def test_nbdev_test_skips_gpu_cells_with_arguments(tmp_path, monkeypatch):
    "`nbdev_test` skips a `#| gpu` cell by the directive's name, whatever follows it."
    from nbdev.test import test_nb
    monkeypatch.delenv("IN_TEST", raising=False)           # test_nb sets it; put it back as it was
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
                    for src in ("x = 1", "#| gpu lora_bug_h200.json\nraise RuntimeError('ran')",
                                "#| gpu check tests/test_kernels.py::test_matches_reference that it ran\n1 / 0")],
          "metadata": {"kernelspec": {"language": "python", "name": "python3", "display_name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    f = tmp_path/"gpu.ipynb"
    f.write_text(json.dumps(nb))
    assert test_nb(f, skip_flags=["gpu"], showerr=False)[0] is True
    assert test_nb(f, skip_flags=[], showerr=False)[0] is False       # the cells do fail when they run


# What a cell's source displays: an output the page must show. A bare last expression displays its value (unless the
# line ends in `;`), except a call to one of these, which return None; so does a top-level print, display or plot.
SHOWS = {"print", "display", "Markdown", "HTML", "show_doc", "show", "imshow", "plot", "bar", "subplots"}
QUIET = re.compile(r"_?test_\w+|check_\w+|assert\w*|close|savefig|seed|manual_seed_all|sleep|append|extend|update|sort|clear"
                   r"|unlink|mkdir|rmtree|write_text|set_\w+|tight_layout|setattr|exec|register\w*")


def _name(f) -> str:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _top_level(body):
    "The nodes of `body`, without what functions, classes and lambdas define."
    todo = list(body)
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def displays(src: str) -> bool:
    "Whether a cell with code `src` shows something: a table, a plot, a print, a last expression's value."
    code = "\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("#|", "%", "!")))
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return False
    if any(isinstance(n, ast.Call) and _name(n.func) in SHOWS for n in _top_level(body)):
        return True
    last = body[-1] if body else None
    if not isinstance(last, ast.Expr) or code.rstrip().endswith(";"):
        return False
    return not (isinstance(last.value, ast.Call) and QUIET.fullmatch(_name(last.value.func) or ""))


class PageCells(HTMLParser):
    "The code cells of a smalldocs page: for each `<div class=\"cell\" id=...>`, whether an output in it shows anything."
    def __init__(self):
        super().__init__()
        self.stack, self.cells, self.out = [], {}, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        cell = next((c for c in reversed(self.stack) if c and c[0] == "cell"), None)
        if tag == "div":
            if "cell" in cls and a.get("id"):
                self.cells[a["id"]] = False
                self.stack.append(("cell", a["id"]))
            elif "cell-output" in cls and cell:
                self.stack.append(("output", cell[1]))
            else:
                self.stack.append(None)
        if tag in ("img", "svg", "table") and any(c and c[0] == "output" for c in self.stack):
            self.cells[next(c for c in reversed(self.stack) if c and c[0] == "output")[1]] = True

    def handle_endtag(self, tag):
        if tag == "div" and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        out = next((c for c in reversed(self.stack) if c and c[0] == "output"), None)
        if out and data.strip():
            self.cells[out[1]] = True


def _hidden_output(src: str) -> bool:
    "Whether the cell's options keep its output off the page."
    return re.search(r"^#\|\s*(output|include):\s*false", src, re.M) is not None


def test_displaying_cells_show_their_output(book):
    """A code cell whose source shows something (a table, a plot, a print, a last expression) has outputs in `_proc/`
    and an output that shows something on its page; a GPU cell shows its note."""
    dest, proc, _ = book
    blank = []
    for nb_path in sorted(proc.glob("*.ipynb")):
        cells = json.loads(nb_path.read_text())["cells"]
        parser = PageCells()
        parser.feed((dest/nb_path.with_suffix(".html").name).read_text(encoding="utf-8"))
        for i, c in enumerate(cells):
            src = "".join(c["source"])
            if c["cell_type"] != "code" or not displays(src) or _hidden_output(src):
                continue
            if not c.get("outputs") or not parser.cells.get(f"cell-{i}"):
                blank.append(f"{nb_path.name} cell-{i}: {src.strip().splitlines()[-1][:80]}")
    assert not blank, "cells that display something but show nothing:\n" + "\n".join(blank)
    for nb, _, _ in gpu_cells():
        notes = (dest/Path(nb).with_suffix(".html").name).read_text(encoding="utf-8").count("gpu-note")
        assert notes == sum(n == nb for n, _, _ in gpu_cells()), f"{nb}: {notes} GPU notes"


def test_gpu_notes_say_where_the_result_is(book):
    "A note names the record, and where the book shows it, or the test that runs the cell's check."
    dest, _, _ = book
    def notes(page):
        text = (dest/page).read_text(encoding="utf-8")
        return [re.sub(r"<[^>]+>", "", m) for m in re.findall(r'gpu-note".*?callout-body">(.*?)</div>', text, re.S)]
    assert any("lora_bug_h200.json (shown below)" in n for n in notes("07_lora_bug.html"))
    assert any("tests/test_kernels.py::test_matches_reference runs the same check" in n for n in notes("04_v1.html"))
    text = (dest/"07_lora_bug.html").read_text(encoding="utf-8")
    assert text.count('callout-title-container flex-fill">Needs a GPU</div>') == len(notes("07_lora_bug.html")) == 2


def test_images_exist(book):
    "Every picture a page links, `<img src=...>` in its HTML or `![...](...)` in its notebook's Markdown, exists."
    dest, proc, _ = book
    for page in dest.glob("*.html"):
        for src in re.findall(r'<img\b[^>]*\bsrc="([^"]+)"', page.read_text(encoding="utf-8")):
            if not src.startswith(("data:", "http://", "https://")):
                assert (page.parent/html.unescape(src).split("#")[0]).is_file(), f"{page.name} links {src}, missing"
    for nb_path in proc.glob("*.ipynb"):
        for c in json.loads(nb_path.read_text())["cells"]:
            if c["cell_type"] == "markdown":
                for src in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", "".join(c["source"])):
                    if not src.startswith(("data:", "http://", "https://", "attachment:")):
                        assert (nb_path.parent/src).is_file(), f"{nb_path.name} links {src}, missing"


FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
BOOK_LINK = re.compile(r"\]\(((?:\d+[a-z]?_\w+|index)\.ipynb)?#([^)\s]+)\)")


def heading_ids(nb: dict) -> set:
    """The identifiers of a notebook's headings, in its Markdown and in its stored Markdown outputs (`show_doc`'s), as
    smalldocs makes them: Pandoc's rules on the heading's plain text, `-1`, `-2`... after a repeat, or the `{#id}`."""
    from smalldocs.markdown import pandoc_id
    ids = set()
    for c in nb["cells"]:
        texts = ["".join(c["source"])] if c["cell_type"] == "markdown" else []
        texts += ["".join(o["data"]["text/markdown"]) for o in c.get("outputs", [])
                  if "text/markdown" in o.get("data", {})]
        for text in texts:
            for head in HEADING.findall(FENCE.sub("", text)):
                given = re.search(r"\{#([\w.-]+)[^}]*\}$", head)
                plain = re.sub(r"[`*]", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"\{[^}]*\}$", "", head)))
                base = given.group(1) if given else pandoc_id(plain)
                ident, n = base, 0
                while ident in ids and not given:
                    n, ident = n + 1, f"{base}-{n + 1}"
                ids.add(ident)
    return ids


def test_links_into_the_book_land_on_a_heading():
    "Every link `NN_name.ipynb#anchor` (or `#anchor`) in a chapter's Markdown names a heading of that chapter."
    nbs = {p.name: json.loads(p.read_text()) for p in sorted(NBS.glob("*.ipynb"))}
    ids = {name: heading_ids(nb) for name, nb in nbs.items()}
    dead = [f"{name}: {target or name}#{anchor}" for name, nb in nbs.items() for c in nb["cells"]
            if c["cell_type"] == "markdown" for target, anchor in BOOK_LINK.findall("".join(c["source"]))
            if anchor not in ids.get(target or name, ())]
    assert not dead, "links to no heading:\n" + "\n".join(dead)


def test_heading_ids_follow_smalldocs():
    lines = ["## The `int4_pg` kernel, [measured](x.ipynb)\n", "## A, b\n", "## A b\n", "## Other {#named}\n",
             "```\n# not a heading\n```"]
    nb = {"cells": [{"cell_type": "markdown", "source": lines}]}
    assert heading_ids(nb) == {"the-int4_pg-kernel-measured", "a-b", "a-b-1", "named"}


SHOW_DOC = re.compile(r"show_doc\(([\w.]+)\)")


def doc_words(md: str) -> str:
    """What a `show_doc` output says, whatever the layout: its signature and docstring, comments, italics and line
    breaks gone (a class defined in a notebook shows no field comments, the module's does), without the source link,
    whose line number moves with every edit above the definition."""
    md = re.sub(r"^\[source\]\(.*$", "", md, flags=re.M)
    md = re.sub(r"#[^\n]*", "", re.sub(r"^#+ .*$", "", md, flags=re.M))        # the heading, then comments
    return re.sub(r",?\s*\)", ")", " ".join(md.replace("*", "").split()).replace("( ", "("))


def stored_show_docs():
    "Every `show_doc(name)` cell with a stored output: (notebook, name, the stored Markdown, the modules it may be in)."
    for p in sorted(NBS.glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        mods = re.findall(r"^#\|\s*default_exp\s+(\S+)", code, re.M)
        mods += re.findall(r"^from w4a4_book\.([\w.]+) import", code, re.M)
        for c in cells:
            m = c["cell_type"] == "code" and SHOW_DOC.fullmatch("".join(c["source"]).strip())
            md = [o["data"]["text/markdown"] for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})]
            if m and md:
                yield p.name, m.group(1), "".join(md[0]), mods


def test_stored_show_docs_match_the_code():
    "A stored `show_doc` output says what `show_doc` says now: the same signature and docstring."
    import importlib
    from nbdev.showdoc import show_doc
    stale = set()
    for nb, name, stored, mods in stored_show_docs():
        spaces = [vars(importlib.import_module(f"w4a4_book.{m}")) for m in mods]
        obj = next(eval(name, s) for s in spaces if name.split(".")[0] in s)
        if doc_words(show_doc(obj)._repr_markdown_()) != doc_words(stored):
            stale.add(f"{nb}: {name}")
    assert not stale, "stale show_doc outputs (python tools/refresh_outputs.py NOTEBOOK):\n" + "\n".join(sorted(stale))


def test_stored_notebooks_carry_no_figures():
    "No stored output is an image: the render draws each figure again, and the tracked tree stays small."
    figures = [f"{p.name} cell {c.get('id')}" for p in sorted(NBS.glob("*.ipynb"))
               for c in json.loads(p.read_text())["cells"]
               if any(k.startswith("image/") for o in c.get("outputs", []) for k in o.get("data", {}))]
    assert not figures, "figures stored (python tools/refresh_outputs.py drops them):\n" + "\n".join(figures)
