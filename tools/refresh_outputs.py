"""Run chapters on this machine and store every cell's output in the notebook, so that the rendered book shows the
results (`w4a4-book render` runs only the exported and `show_doc` cells). Cells marked `#| gpu` are not run and keep
the outputs they had. Run `nbdev_clean` afterwards, as before any commit.

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
