"""Part I reads as a story: at most `STORY_WORDS` words of prose, with no commit hash, record file name, issue, session
or branch in it (those belong to captions, footers and the appendices), and no exported cell over `CELL_LINES` lines.

    python tests/test_story.py      # words and offending lines, chapter by chapter
"""
import json
import re
from pathlib import Path

from test_book import PART_I

ROOT = Path(__file__).resolve().parent.parent
STORY = ["index", *PART_I]                      # the introduction and Part I, as the sidebar orders them
STORY_WORDS, CELL_LINES = 20_000, 60
# what a lab notebook says and a story does not: a commit hash (hex with a digit and a letter), a file the records or
# figures live in, and the project's own bookkeeping (an issue or session of its work, a git branch)
LOG = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
                 r"|\b[\w-]+\.(?:json|png|csv|npz|pt)\b"
                 r"|\bsessions?\b|\bissue\s?#?\d+|\b(?:this|the|an|open) issues?(?=[.,;:]|\s+(?:asks|says|wants|filed|notes))"
                 r"|\bbranch(?:es)?\s+`|\bon (?:the )?branch\b|\bmerged\b|\bgit\b", re.I)


def prose(nb: str) -> str:
    "The markdown of chapter `nb`, without fenced code and HTML comments."
    cells = json.loads((ROOT/"nbs"/f"{nb}.ipynb").read_text())["cells"]
    md = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.sub(r"<!--.*?-->", "", re.sub(r"^```.*?^```", "", md, flags=re.M | re.S), flags=re.S)


def words(nb: str) -> int:
    return len(prose(nb).split())


def log_lines(nb: str) -> list:
    "The lines of chapter `nb`'s prose that read like a lab notebook, with what matched."
    return [(m.group(0), line.strip()[:100]) for line in prose(nb).splitlines() for m in LOG.finditer(line)]


def long_exports(nb: str) -> list:
    "`(cell index, lines)` of each exported cell of chapter `nb` longer than `CELL_LINES`."
    cells = json.loads((ROOT/"nbs"/f"{nb}.ipynb").read_text())["cells"]
    return [(i, len(src.splitlines())) for i, c in enumerate(cells) if c["cell_type"] == "code"
            for src in ["".join(c["source"])] if re.match(r"#\|\s*export", src) and len(src.splitlines()) > CELL_LINES]


def test_the_story_fits_its_length():
    counts = {nb: words(nb) for nb in STORY}
    assert sum(counts.values()) <= STORY_WORDS, counts


def test_the_story_is_not_a_lab_notebook():
    found = {nb: log_lines(nb) for nb in STORY}
    assert not any(found.values()), {nb: f for nb, f in found.items() if f}


def test_the_story_shows_code_in_short_cells():
    found = {nb: long_exports(nb) for nb in STORY}
    assert not any(found.values()), {nb: f for nb, f in found.items() if f}


def test_the_checks_catch_a_log():
    for s in ("fixed in 7296e90", "see lora_bug_h200.json", "this session", "the issue asks", "on the branch",
              "the branch `exp-x`", "once merged"):
        assert LOG.search(s), s
    for s in ("the MMA branch", "four warps issue it", "the issue-slot ceiling", "issues its MMAs", "128x128", "b200"):
        assert not LOG.search(s), s


if __name__ == "__main__":
    for nb in STORY:
        print(f"{words(nb):6d} {nb}  long cells: {long_exports(nb)}")
        for hit in log_lines(nb): print("        ", hit)
    print(f"{sum(map(words, STORY)):6d} of {STORY_WORDS}")
