"""The read-rate memo's file handling (kvstream_backend.tiers.rates) on real directories."""

from __future__ import annotations

import os

import msgspec

from kvstream_backend.tiers import rates

SETUP = "threads,direct,real"


def _memo(bps: float = 2e9, size: float = 16e6) -> rates.RateMemo:
    return rates.RateMemo(bps, size, SETUP, 1.7e9)


def test_a_memo_round_trips_per_set_up(tmp_path):
    base = str(tmp_path)
    rates.save(base, _memo(), 0o700, 0o600)
    assert rates.load(base, SETUP) == _memo()
    assert rates.load(base, "uring,direct,real") is None  # another set-up has its own file
    (path,) = [os.path.join(base, rates.DIR, n) for n in os.listdir(os.path.join(base, rates.DIR))]
    assert path == rates.memo_path(base, SETUP) and os.stat(path).st_mode & 0o777 == 0o600


def test_a_nonsensical_memo_is_ignored_and_named(tmp_path, kvlog):
    base = str(tmp_path)
    os.mkdir(os.path.join(base, rates.DIR))
    for bad in (_memo(bps=0.0), _memo(size=-1.0)):
        with open(rates.memo_path(base, SETUP), "wb") as f:
            f.write(msgspec.json.encode(bad))
        assert rates.load(base, SETUP) is None
    assert kvlog.text.count(rates.memo_path(base, SETUP)) == 2


def test_a_memo_is_never_written_through_a_symlink(tmp_path, kvlog):
    base, elsewhere = tmp_path / "kvs1", tmp_path / "elsewhere"
    base.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, base / rates.DIR)
    rates.save(str(base), _memo(), 0o700, 0o600)
    assert os.listdir(elsewhere) == [] and "cannot save the read-rate memo" in kvlog.text
    os.unlink(base / rates.DIR)
    (base / rates.DIR).mkdir()
    os.symlink(elsewhere / "target.json", rates.memo_path(str(base), SETUP))
    (elsewhere / "target.json").write_bytes(msgspec.json.encode(_memo()))
    assert rates.load(str(base), SETUP) is None  # nor read through one
