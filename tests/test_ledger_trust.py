"""Whose key signed a ledger: rewrites re-signed with a fresh key are never called verified
without a key the reader trusts, and are refused with one.

The attacker here rewrites the whole ledger (as whoever can write the run directory can) and
signs it with a fresh run key of their own: every link and signature of the forgery holds.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dpfy import accounting
from dpfy.cli import main
from dpfy.ledger import Ledger, LedgerIntegrityError
from dpfy.ledger.trust import (
    ENDORSEMENT_FIELD,
    INTACT,
    TRUSTED,
    assess,
    endorse,
    fingerprint,
    load_long_lived_key,
    new_long_lived_key,
    read_trusted_key,
)
from dpfy.report import build_report
from dpfy.sampling import SampleSpec

DELTA = 1e-5


def _write_run(path: Path, *, steps: int, noise_std: float, key_file: Path | None,
               endorsement: dict | None = None) -> Ledger:
    """A closed, signed run; endorsed by the long-lived key in ``key_file`` (or carrying the
    given ``endorsement`` verbatim, as a forger copying it would)."""
    spec = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01)
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(path)
    for step in range(steps):
        sid = ledger.record_sample(spec, step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=noise_std, name="grad")
    eps = accounting.epsilon(ledger, DELTA, "rdp").epsilon
    ledger.record_metadata(epsilon=eps, accounting="rdp", delta=DELTA)
    if key_file is not None:
        endorse(ledger, load_long_lived_key(key_file))
    if endorsement is not None:
        ledger.record_metadata(**{ENDORSEMENT_FIELD: endorsement})
    ledger.close()
    return ledger


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The original run (16 steps at noise 1, endorsed by the organisation's key) and three
    forgeries of it, each a whole new ledger signed with a fresh run key."""
    root = tmp_path_factory.mktemp("trust")
    key = root / "org.key"
    new_long_lived_key(key)
    original = root / "original" / "ledger.jsonl"
    kept = _write_run(original, steps=16, noise_std=1.0, key_file=key)
    copied = kept.metadata[ENDORSEMENT_FIELD]
    forged = {
        # fewer releases, with the original's endorsement copied in
        "fewer": dict(steps=4, noise_std=1.0, endorsement=copied),
        # quieter releases: the same steps with a larger recorded noise
        "quieter": dict(steps=16, noise_std=4.0, endorsement=None),
        # the same releases under a fresh run id (and key), endorsed by the forger's own key
        "fresh_id": dict(steps=16, noise_std=1.0, endorsement=None),
    }
    paths = {"original": original, "key": key}
    forger_key = root / "forger.key"
    new_long_lived_key(forger_key)
    for name, how in forged.items():
        path = root / name / "ledger.jsonl"
        _write_run(path, key_file=forger_key if name == "fresh_id" else None, **how)
        paths[name] = path
    return paths


@pytest.mark.parametrize("forgery", ["fewer", "quieter", "fresh_id"])
def test_a_re_signed_rewrite_is_never_verified_without_a_trusted_key_and_refused_with_one(
    runs, forgery, capsys
):
    path, original = runs[forgery], Ledger.load(runs["original"])
    assert Ledger.load(path).verification.complete  # every link and signature of it holds
    assert Ledger.load(path).run_id != original.run_id
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp")
    trust = rep.ledger_integrity["trust"]
    assert trust["level"] == INTACT and "verified" not in rep.formal_statement
    assert "key not checked" in rep.ledger_integrity["summary"]
    assert "self-consistency only" in rep.formal_statement
    integrity = [x for x in rep.to_markdown().splitlines() if "Ledger integrity" in x]
    assert integrity and not any("verified" in x for x in integrity)
    # nor in report.json: no value of its ledger_integrity says verified
    values = [v for v in rep.ledger_integrity.values() if isinstance(v, str)]
    values += [v for v in trust.values() if isinstance(v, str)]
    assert values and not any("verified" in v for v in values), values
    assert trust["verified"] is False
    args = ["report", str(path), "--method", "rdp", "--no-figures"]
    assert main(args) == 0  # intact: one warning line, exit 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpfy: warning:") and "\n" not in err and "key not checked" in err
    # dpfy audit refuses it under the kept key before auditing anything
    audit = ["audit", str(path.parent), "--method", "one-run", "--trials", "4"]
    assert main([*audit, "--public-key", original.verification.public_key]) == 2
    assert "not by the key you trust" in capsys.readouterr().err
    os.remove(path.parent / "report.json")
    # with the organisation's key (file or hex) or the original run key: refused, exit 2
    org = read_trusted_key(Path(f"{runs['key']}.pub"))
    for trusted in (["--trust", f"{runs['key']}.pub"], ["--public-key", org],
                    ["--public-key", original.verification.public_key]):
        assert main([*args, *trusted]) == 2
        err = capsys.readouterr().err.strip()
        assert "not by the key you trust" in err and "\n" not in err
        assert not (path.parent / "report.json").exists()  # nothing written
    with pytest.raises(LedgerIntegrityError, match="rewritten and re-signed"):
        build_report(Ledger.load(path), delta=DELTA, method="rdp", trusted_key=org)


def test_the_original_is_verified_against_the_long_lived_key_or_its_run_key(runs, capsys):
    ledger = Ledger.load(runs["original"])
    org = read_trusted_key(Path(f"{runs['key']}.pub"))
    run_key = ledger.verification.public_key
    for trusted in (org, run_key):
        trust = assess(ledger.verification, ledger.metadata, trusted)
        assert trust.level == TRUSTED and trust.verified and trust.endorsed_by == org
    rep = build_report(ledger, delta=DELTA, method="rdp", trusted_key=org)
    assert f"verified against the key you trust ({fingerprint(org)})" in rep.formal_statement
    assert main(["report", str(runs["original"]), "--method", "rdp", "--no-figures",
                 "--trust", str(runs["key"])]) == 0  # the private key file names it too
    assert capsys.readouterr().err == ""  # verified: no warning
    # a forger's endorsement names its own key, which the reader does not trust
    forged = Ledger.load(runs["fresh_id"])
    trust = assess(forged.verification, forged.metadata)
    assert trust.level == INTACT and trust.endorsed_by not in (None, org)
    # a copied endorsement names the original run key, so it holds for no other
    fewer = Ledger.load(runs["fewer"])
    assert fewer.metadata[ENDORSEMENT_FIELD] == ledger.metadata[ENDORSEMENT_FIELD]
    assert assess(fewer.verification, fewer.metadata).endorsed_by is None


def test_keys_new_writes_a_private_key_0600_and_never_overwrites(tmp_path, capsys):
    key = tmp_path / "me.key"
    assert main(["keys", "new", str(key)]) == 0
    public = Path(f"{key}.pub").read_text().strip()
    assert public in capsys.readouterr().out
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert read_trusted_key(key) == read_trusted_key(Path(f"{key}.pub")) == public
    key.with_name("junk.txt").write_text("not a key\n")
    before = key.read_bytes()
    assert main(["keys", "new", str(key)]) == 2
    assert "exists" in capsys.readouterr().err and key.read_bytes() == before
    with pytest.raises(ValueError, match="trust must be a file holding an Ed25519 public key"):
        read_trusted_key(key.with_name("junk.txt"))
