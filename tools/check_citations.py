"""Check every quote of nbs/citations.json against its source: a commit's message or a file at a commit of the original's
repository, or an article's text. Markdown emphasis and runs of spaces are ignored on both sides.

    python tools/check_citations.py --original PATH/TO/svdquant-kernels [--articles PATH/TO/seeds]

A source it is not given is reported as not checked; any quote not found exits with status 1.
"""
import argparse, json, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def normalize(text: str) -> str:
    "`text` without Markdown bold and with every run of whitespace as one space."
    return re.sub(r"\s+", " ", text.replace("**", "")).strip()


def source_text(source: dict, original: Path | None, articles: Path | None) -> str | None:
    "The text a source names, or None when the folder it lives in was not given."
    if "file" in source:
        return (articles / source["file"]).read_text(encoding="utf-8") if articles else None
    if original is None:
        return None
    what = f"{source['commit']}:{source['path']}" if "path" in source else source["commit"]
    cmd = ["git", "-C", str(original), "show", "-s", "--format=%B", what] if "path" not in source else \
          ["git", "-C", str(original), "show", what]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def check(doc: dict, original: Path | None, articles: Path | None) -> list:
    "`(id, status)` per figure: 'found', 'not found' or 'not checked'."
    texts, out = {}, []
    for f in doc["figures"]:
        src = doc["sources"][f["source"]]
        if f["source"] not in texts:
            texts[f["source"]] = None if isinstance(src, str) else source_text(src, original, articles)
        text = texts[f["source"]]
        status = "not checked" if text is None else ("found" if normalize(f["quote"]) in normalize(text) else "not found")
        out.append((f["id"], status))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--original", type=Path, help="a clone of ultism/svdquant-kernels")
    ap.add_argument("--articles", type=Path, help="the folder holding the articles' texts")
    a = ap.parse_args(argv)
    doc = json.loads((ROOT / "nbs" / "citations.json").read_text(encoding="utf-8"))
    results = check(doc, a.original, a.articles)
    for fid, status in results:
        print(f"{status:>11}  {fid}")
    return int(any(s == "not found" for _, s in results))


if __name__ == "__main__":
    sys.exit(main())
