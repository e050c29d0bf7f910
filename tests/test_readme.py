"The README: its Results section is exactly what the records generate, and it gives exactly two commands to run."
import json
import re
from pathlib import Path

from w4a4_book.bench.report import LORA_RECORD, README_RECORDS, readme_results, readme_table
from w4a4_book.records import data_dir, load_record

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT/"README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}


def test_table_is_generated_from_the_records():
    rows = [r for name in README_RECORDS for r in load_record(data_dir()/name)[1]]
    assert readme_table(rows) in README


def test_results_section_is_generated_from_the_records():
    section = README[README.index("## Results\n"):README.index("\n## ", README.index("## Results\n") + 1)]
    assert readme_results() in section, ("README.md's Results section differs from the records; regenerate it with "
                                         "w4a4_book.bench.report.readme_results() instead of editing it")
    from w4a4_book.repro import LADDER_RECORDS, readme_ladder
    assert readme_ladder() in section, "regenerate the ladder with w4a4_book.repro.readme_ladder()"
    for name in README_RECORDS + (LORA_RECORD,) + LADDER_RECORDS:
        assert f"`{name}`" in section and load_record(data_dir()/name)[0]["command"] in section


def _commands(text: str) -> list[str]:
    return [body.strip() for lang, body in FENCE.findall(text) if lang in SHELL]


def test_exactly_two_command_blocks():
    langs = [lang for lang, _ in FENCE.findall(README)]
    assert [lang for lang in langs if lang] == ["bash", "bash"], langs   # the operator's formula is the only other block
    assert len(_commands(README)) == 2


def test_commands_match_the_introduction():
    nb = json.loads((ROOT/"nbs"/"index.ipynb").read_text(encoding="utf-8"))
    intro = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert _commands(README) == _commands(intro)
