"""`infra.provenance`: the commit, seed and resolved config a result file records."""

import subprocess

from sage_jax.infra import provenance


def test_commit_is_the_checkouts_head_and_says_when_it_is_dirty():
    head = subprocess.run(["git", "-C", str(provenance.SOURCE), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(provenance.SOURCE), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert provenance.commit() == head + ("+dirty" if dirty else "")


def test_no_checkout_is_said_plainly(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "SOURCE", tmp_path)  # not a git repository
    provenance.commit.cache_clear()
    try:
        assert provenance.commit() == provenance.NO_CHECKOUT
    finally:
        provenance.commit.cache_clear()


def test_record_holds_commit_seed_and_config():
    rec = provenance.record({"train": {"seed": 3}}, 3)
    assert rec == {"commit": provenance.commit(), "seed": 3, "config": {"train": {"seed": 3}}}
