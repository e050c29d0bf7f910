"The measured-data convention: a record without provenance is rejected on the way in and on the way out."
import json

import pytest

from w4a4_book.records import (REQUIRED_PROVENANCE, data_dir, list_records, load_record, load_rows, markdown_table,
                               provenance, save_record, validate)

GOOD = dict(gpu="NVIDIA H200", driver="580.00", torch="2.11.0+cu130", cutlass_dsl="4.3.5", commit="abc1234",
            date="2026-12-01T00:00:00+00:00", shapes=[[256, 3072, 3840, 32]], command="w4a4-book bench --shape 256")
ROWS = [dict(M=256, N=3072, K=3840, us=12.5, kernel="v1"), dict(M=512, N=3072, K=3840, us=20.0, kernel="v1")]


@pytest.mark.parametrize("key", REQUIRED_PROVENANCE)
@pytest.mark.parametrize("how", ["missing", "empty"])
def test_each_missing_key_is_named(key, how):
    prov = {k: v for k, v in GOOD.items() if k != key} if how == "missing" else {**GOOD, key: "" if key != "shapes" else []}
    with pytest.raises(ValueError, match=key):
        validate(prov)


def test_every_missing_key_is_named_at_once():
    with pytest.raises(ValueError) as e:
        validate({"gpu": "NVIDIA H200"})
    assert all(k in str(e.value) for k in REQUIRED_PROVENANCE if k != "gpu")


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_save_rejects_record_without_provenance(tmp_path, suffix):
    with pytest.raises(ValueError, match="provenance"):
        save_record(tmp_path/f"r{suffix}", {}, ROWS)
    assert not (tmp_path/f"r{suffix}").exists()


def test_load_rejects_record_without_provenance(tmp_path):
    (tmp_path/"bare.json").write_text(json.dumps({"rows": ROWS}))
    (tmp_path/"thin.json").write_text(json.dumps({"provenance": {**GOOD, "commit": ""}, "rows": ROWS}))
    (tmp_path/"bare.csv").write_text("M,N\n1,2\n")
    with pytest.raises(ValueError, match="'provenance' and 'rows'"):
        load_record(tmp_path/"bare.json")
    with pytest.raises(ValueError, match="thin.json: provenance is missing or has empty: commit"):
        load_record(tmp_path/"thin.json")
    with pytest.raises(ValueError, match="first line"):
        load_record(tmp_path/"bare.csv")


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_round_trip(tmp_path, suffix):
    path = save_record(tmp_path/"sub"/f"bench-demo{suffix}", GOOD, ROWS)
    assert load_record(path) == (GOOD, ROWS)


@pytest.mark.parametrize("rows, err", [([], ValueError), ([1], TypeError), ("rows", ValueError)])
def test_bad_rows(tmp_path, rows, err):
    with pytest.raises(err, match="rows"):
        save_record(tmp_path/"r.json", GOOD, rows)


def test_csv_needs_flat_rows(tmp_path):
    with pytest.raises(TypeError, match="rows\\[0\\]"):
        save_record(tmp_path/"r.csv", GOOD, [dict(M=1, shape=[1, 2])])
    save_record(tmp_path/"r.json", GOOD, [dict(M=1, shape=[1, 2])])


def test_provenance_on_this_machine():
    p = provenance("pytest", [[1, 2, 3]], tile="128x128")
    assert validate(p) is p and p["tile"] == "128x128" and p["command"] == "pytest"
    with pytest.raises(ValueError, match="torch"):
        provenance("pytest", [[1, 2, 3]], torch="9.9")


def test_checked_in_records_are_valid():
    "Every file in nbs/data/ must load: this is the gate for measured results."
    assert data_dir().parts[-2:] == ("nbs", "data")
    for path in list_records():
        load_record(path)
    for kind in {p.name.split("-")[0].split("_")[0] for p in list_records()}:
        assert all("gpu" in r and "record" in r for r in load_rows(kind))


def test_markdown_table():
    t = markdown_table(ROWS, ["kernel", "M", "us"]).splitlines()
    assert t == ["| kernel | M | us |", "|---|---:|---:|", "| v1 | 256 | 12.5 |", "| v1 | 512 | 20 |"]
    with pytest.raises(ValueError, match="column"):
        markdown_table([{}])


def test_commit_env_must_be_a_full_sha(monkeypatch):
    "A short or mistyped `$W4A4_BOOK_COMMIT` is refused by name: a record must name a commit a reader can check out."
    from w4a4_book import records
    monkeypatch.setenv(records.COMMIT_ENV, "a51aba0b")
    with pytest.raises(ValueError, match="W4A4_BOOK_COMMIT='a51aba0b'"):
        records._git_commit()
    monkeypatch.setenv(records.COMMIT_ENV, "a" * 40)
    assert records._git_commit() == "a" * 40
