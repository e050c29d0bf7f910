"""A non-editable install (`pip install .`) carries the records and the citations inside the package, so that its
`w4a4-book repro lora-bug` reproduces the recorded output from any folder. Built offline, from a copy of the files a
source distribution holds (MANIFEST.in), with the environment's setuptools."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from w4a4_book import records, repro

ROOT = Path(__file__).resolve().parent.parent


def _source_copy(dest: Path) -> Path:
    "The files a build reads, copied to `dest` (a build writes build/ and *.egg-info beside them, not in the checkout)."
    for name in ("setup.py", "settings.ini", "README.md", "MANIFEST.in", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "w4a4_book", dest / "w4a4_book", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "nbs").mkdir()
    shutil.copytree(ROOT / "nbs" / "data", dest / "nbs" / "data")
    shutil.copy2(ROOT / "nbs" / records.CITATIONS, dest / "nbs" / records.CITATIONS)
    return dest


def test_installed_copy_reproduces_the_lora_bug(tmp_path):
    src, site, away = tmp_path / "src", tmp_path / "site", tmp_path / "away"
    src.mkdir()
    away.mkdir()
    _source_copy(src)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(site), str(src)]
    r = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = site / "w4a4_book" / records.PACKAGED_RECORDS
    assert (data / records.CITATIONS).is_file()
    assert sorted(p.name for p in (data / "data").iterdir()) == sorted(p.name for p in records.list_records())
    code = ("import sys, w4a4_book; from w4a4_book.cli import main; "
            "print('FILE=' + w4a4_book.__file__, file=sys.stderr); sys.exit(main(['repro', 'lora-bug', '--all']))")
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=away, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    files = [l[5:] for l in r.stderr.splitlines() if l.startswith("FILE=")]
    assert files and files[0].startswith(str(site)), r.stderr          # the installed copy ran, not the checkout
    assert r.stdout.splitlines()[0] == repro.summary()
    assert "No recorded" not in r.stdout
    for path in records.list_records("lora_bug"):
        assert f"recorded: `{path.name}`" in r.stdout
