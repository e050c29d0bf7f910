"""The command line the record tools share: `--out` and the tool's numeric options, and the command a record names
(only the options that differ from their defaults, the output under nbs/data/)."""
import argparse, sys
from pathlib import Path


def parse(doc: str, argv, **defaults) -> argparse.Namespace:
    "`--out PATH` and `--NAME` (an int, default `defaults[NAME]`) for each of `defaults`; puts this checkout on sys.path."
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    for name, value in defaults.items():
        ap.add_argument(f"--{name}", type=int, default=value)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    return a


def command(script: str, a: argparse.Namespace, **defaults) -> str:
    "The command line that re-measures `a`'s record: `python tools/SCRIPT --out nbs/data/NAME` and the options not at their defaults."
    return f"python tools/{script} --out nbs/data/{a.out.name}" + "".join(
        f" --{name} {getattr(a, name)}" for name, value in defaults.items() if getattr(a, name) != value)
