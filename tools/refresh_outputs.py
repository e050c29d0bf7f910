"""Run chapters on this machine and store every cell's output in the notebook, so that the notebook, read as it is
stored, shows the results (`w4a4-book render` runs them again, but the `#| gpu` and `eval: false` ones). Cells marked `#| gpu` are
not run and keep the outputs they had. An output stored in a richer form (Markdown, HTML, an image) drops its
plain-text copy, which nothing shows. Run `nbdev_clean` afterwards, as before any commit.

    python tools/refresh_outputs.py nbs/07_lora_bug.ipynb [more notebooks]
"""
import re, sys
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell
from fastcore.xtras import working_directory

GPU_CELL = re.compile(r"^#\|\s*gpu\b", re.M)


def refresh(path: Path) -> None:
    "Execute `path`'s code cells but the `#| gpu` ones, in order, stopping at the first error; write their outputs back."
    nb = read_nb(path)
    shell = CaptureShell(path)
    with working_directory(path.parent):
        shell.run_all(nb, exc_stop=True, preproc=lambda c: c.cell_type != "code" or bool(GPU_CELL.search(c.source)))
    for c in nb.cells:
        if c.cell_type == "code" and not GPU_CELL.search(c.source):
            for o in c.get("outputs", []):      # a plain-text copy beside Markdown, HTML or an image: no viewer shows it
                if len(o.get("data", {})) > 1:
                    o["data"].pop("text/plain", None)
    write_nb(nb, path)


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
