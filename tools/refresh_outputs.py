"""Run chapters on this machine and store every cell's output in the notebook, so that the notebook, read as it is
stored, shows the results (`w4a4-book render` runs them again, but the `#| gpu` and `eval: false` ones). Cells marked
`#| gpu` are not run and keep the outputs they had. A figure is not stored (the render draws it again, and the tracked
tree stays small), and an output stored in a richer form (Markdown, HTML) drops its plain-text copy, which nothing
shows. Run `nbdev_clean` afterwards, as before any commit.

    python tools/refresh_outputs.py nbs/07_lora_bug.ipynb [more notebooks]
"""
import re, sys
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell
from fastcore.xtras import working_directory

GPU_CELL = re.compile(r"^#\|\s*gpu\b", re.M)


def refresh(path: Path) -> None:
    "Execute `path`'s code cells but the `#| gpu` ones, in order, stopping at the first error; store their outputs."
    nb = read_nb(path)
    shell = CaptureShell(path)
    with working_directory(path.parent):
        shell.run_all(nb, exc_stop=True, preproc=lambda c: c.cell_type != "code" or bool(GPU_CELL.search(c.source)))
    for c in nb.cells:
        if c.cell_type == "code" and not GPU_CELL.search(c.source):
            c.outputs = [o for o in map(stored_form, c.get("outputs", [])) if o is not None]
    write_nb(nb, path)


def stored_form(output: dict) -> dict | None:
    "`output` as a notebook stores it: None for a figure, and no plain-text copy beside a richer form."
    data = output.get("data", {})
    if any(k.startswith("image/") for k in data):
        return None
    if len(data) > 1:                           # a plain-text copy beside Markdown or HTML: no viewer shows it
        data.pop("text/plain", None)
    return output


def main(argv=None) -> int:
    paths = [Path(p).resolve() for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        raise SystemExit(__doc__)
    for p in paths:
        refresh(p)
        print(f"refreshed {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
