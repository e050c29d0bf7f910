"The README: its Results section is exactly what the records generate, it gives exactly two commands to run, and its example runs."
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
    from w4a4_book.bench.flux import readme_flux
    assert readme_flux() in section, "regenerate the FLUX paragraph with w4a4_book.bench.flux.readme_flux()"
    for name in README_RECORDS + (LORA_RECORD,) + LADDER_RECORDS:
        assert f"`{name}`" in section and load_record(data_dir()/name)[0]["command"] in section


def _commands(text: str) -> list[str]:
    return [body.strip() for lang, body in FENCE.findall(text) if lang in SHELL]


def test_exactly_two_command_blocks():
    langs = [lang for lang, _ in FENCE.findall(README)]
    assert [lang for lang in langs if lang] == ["bash", "bash", "python"], langs   # and the operator's formula, untagged
    assert len(_commands(README)) == 2


def test_the_use_section_runs(tmp_path, monkeypatch):
    "The example of '## Use it', about ten lines, runs on the CPU: it converts, runs, saves, loads and compiles a model."
    start = README.index("## Use it\n")
    section = README[start:README.index("\n## ", start + 1)]
    blocks = [body for lang, body in FENCE.findall(section) if lang == "python"]
    assert len(blocks) == 1 and 8 <= len(blocks[0].strip().splitlines()) <= 12
    assert README.index("## Two commands") < start < README.index("## Results")
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "model.safetensors").is_file()


def test_commands_match_the_introduction():
    nb = json.loads((ROOT/"nbs"/"index.ipynb").read_text(encoding="utf-8"))
    intro = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert _commands(README) == _commands(intro)
