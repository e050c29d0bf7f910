"""Every percentage and ratio the book writes in prose is held: by a check in its own notebook, by a cited figure of
the original work, or by a short allowlist that says why."""
import ast
import json
import re
from pathlib import Path

from w4a4_book.records import citations

ROOT = Path(__file__).resolve().parent.parent
NUM = r"\d+(?:\.\d+)?"
# a number or range followed by % or ×, but not a shape: no number, bracket or letter follows the × (256×256, 128 × 128,
# 128 × (24 + 40), 64×N)
FIGURE = re.compile(rf"(?<![\w.,\-–])[+−-]?({NUM}(?:\s?%?\s?(?:[–-]|to)\s?{NUM})?)\s?(%|×)(?!\s?[\d(]|[A-Za-z])")
ORIGINAL = re.compile(r"original|article|write-up|Blackwell|B200|author|commit", re.I)
CHECKS = {"test_eq", "test_close", "test_ne", "test_fail", "test_is"}   # nbdev's checks; any assert too

ALLOWED = {}   # (where, figure as written): why no check holds it; empty: every figure is held


def _prose(text: str) -> str:
    "Markdown without its fenced blocks and inline code, where a number is code rather than prose."
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def figures(text: str) -> list[tuple[str, list[str], str]]:
    "`(figure as written, its numbers, its paragraph)` for each percentage or ratio in the prose `text`."
    paras = [p for p in re.split(r"\n\s*\n", _prose(text)) if p.strip()]
    return [(m.group(0).lstrip("+−-"), re.findall(NUM, m.group(1)), p) for p in paras for m in FIGURE.finditer(p)]


def _code(src: str) -> str:
    "A code cell as Python: its IPython magics and shell lines blanked."
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.splitlines())


def _strings(node) -> list[str]:
    "The string literals under `node`, f-strings' text included and their format specs (`.1f`) left out."
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.FormattedValue):
        return _strings(node.value)
    return [s for child in ast.iter_child_nodes(node) for s in _strings(child)]


def checks(src: str) -> list[str]:
    """The strings of each assert and nbdev check (`test_eq`, ...) in the code `src`, one text per check, in order:
    the formatted value a check compares, or an assert's message. Comments and bare numbers do not count."""
    out = []
    for node in ast.walk(ast.parse(_code(src))):
        if isinstance(node, ast.Assert):
            parts = [node.test, node.msg]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in CHECKS:
            parts = node.args + [k.value for k in node.keywords]
        else:
            continue
        out.append((node.lineno, " | ".join(s for p in parts if p is not None for s in _strings(p))))
    return [text for _, text in sorted(out)]


def _holds(check: str, numbers: list[str]) -> bool:
    "Whether each of `numbers` is written in `check` as a number of its own (not inside 1.25, v2 or 0.003)."
    return all(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w|\.\d)", check) for n in numbers)


def _cited() -> set[str]:
    """Every number of `citations()`, as written; the first fix's two speed-ups (its quoted rows' ratios, to one
    decimal); and the second fix's same-card factor (the ncu durations' ratio, to two decimals)."""
    cites = citations()
    out = {format(v, "g") if float(v) != int(v) else str(int(v)) for c in cites.values() for v in c["values"]}
    out |= {f"{float(v):.1f}" for c in cites.values() for v in c["values"] if float(v) != int(v)}
    before, after = cites["fix_ncu_same_card"]["values"][:2]      # the second fix on one B200: ncu, before over after
    return out | {f"{cites[k]['values'][0] / cites[k]['values'][1]:.1f}" for k in ("commit_small_k", "commit_r32")} \
               | {f"{before / after:.2f}"}


def _pages() -> list[tuple[str, str, list[str]]]:
    "`(where, prose, checks)`: each notebook's markdown and the checks of its code cells; the README outside its Results."
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("## Results\n")
    out = [("README.md", readme[:start] + readme[readme.index("\n## ", start + 1):], [])]
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        md = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        out.append((nb.name, md, [k for c in cells if c["cell_type"] == "code" for k in checks("".join(c["source"]))]))
    return out


PAGES = _pages()
CITED = _cited()


def test_the_pattern():
    text = ("It costs 18–22 % and runs 1.2–1.3× faster, 0.87× the GEMM, at +20–25 % or 51–82 %; "
            "a 256×256 tile, a 128 × 128 one, 128 × (24 + 40), a 64×N one, 4-bit × 4-bit, 45% to 63% MFU.")
    assert [f for f, _, _ in figures(text)] == ["18–22 %", "1.2–1.3×", "0.87×", "20–25 %", "51–82 %", "45% to 63%"]
    assert [n for _, n, _ in figures(text)][-1] == ["45", "63"]
    assert not figures("see `x = 3 %` and\n```\ny = 2×\n```\n")


def test_checks_read_strings_not_comments():
    src = ('%time\ntest_eq(f"{lo:.1f}–{hi:.1f}", "1.2–1.3")   # "18 %"\nassert x < 0.003, "within 0.3 %"\n'
           'assert len(x) == 5\nprint("5 %")')
    ks = checks(src)
    assert _holds(ks[0], ["1.2", "1.3"]) and not _holds(ks[0], ["18"]) and not _holds(ks[0], ["1.23"])
    assert _holds(ks[1], ["0.3"]) and not any(_holds(k, ["5"]) for k in ks) and not _holds("v2 | R=32x", ["2", "32"])


def test_every_prose_figure_is_held():
    "Each figure: all its numbers in one check of the same notebook, or all cited in a paragraph about the original work."
    unheld, seen = [], 0
    for where, md, ks in PAGES:
        for fig, nums, para in figures(md):
            seen += 1
            if (where, fig) in ALLOWED or any(_holds(k, nums) for k in ks):
                continue
            if ORIGINAL.search(para) and all(n in CITED for n in nums):
                continue
            at = para.index(fig)
            unheld.append(f"{where}: {fig!r} in {para[max(0, at - 100):at + 40]!r}")
    assert seen >= 80
    assert not unheld, "prose figures no check holds:\n" + "\n".join(unheld)


def test_the_allowlist_is_used_and_short():
    used = {(w, f) for w, md, _ in PAGES for f, _, _ in figures(md)}
    assert set(ALLOWED) <= used, set(ALLOWED) - used
    assert len(ALLOWED) <= 8 and all(why.strip() for why in ALLOWED.values())
