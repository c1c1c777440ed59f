"""The signed ledger: the run key, the signed head, and the attacks a bare hash chain let pass.

Each attack is played as an attacker who can write the file but holds no private key: edit
the lines, then re-hash every later line with the chain's own hash function so that each
``prev`` matches again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dpfy import accounting
from dpfy.ledger import Ledger, LedgerIntegrityError, signing
from dpfy.ledger.chain import line_hash
from dpfy.report import build_report
from dpfy.sampling import SampleSpec

POISSON = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01)
DELTA = 1e-5


def _run(path: Path, steps: int = 16, *, close: bool = True) -> Ledger:
    """A closed run of ``steps`` steps that records, as training does, its final epsilon."""
    ledger = Ledger(path)
    ledger.record_metadata(model="mlp")
    for step in range(steps):
        sid = ledger.record_sample(POISSON, step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0, name="grad")
    eps = accounting.epsilon(ledger, DELTA, "rdp").epsilon
    ledger.record_metadata(epsilon=eps, accounting="rdp", delta=DELTA)
    if close:
        ledger.close()
    else:
        ledger.flush()
    return ledger


def _objs(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().split(b"\n")[:-1]]


def _rehash(path: Path, objs: list[dict], *, recount: bool = True) -> None:
    """Write ``objs`` back, re-chaining every line (and, with ``recount``, each end record's
    counts) as an attacker without the key would; ``recount=False``: a lazy attacker who
    leaves the end record's counts as they are."""
    out: list[bytes] = []
    head = None
    samples = releases = 0
    for obj in objs:
        obj = dict(obj)
        samples += obj["type"] == "sample"
        releases += obj["type"] in ("sum_query", "non_private", "matrix_step")
        if obj["type"] == "end" and recount:
            obj.update(count=len(out), samples=samples, releases=releases)
        if obj["type"] == "signature" and recount:
            obj["lines"] = len(out)  # the old signature, moved to cover the new head
        if head is not None:
            obj["prev"] = head
        line = json.dumps(obj, separators=(",", ":")).encode()
        out.append(line)
        head = line_hash(line)
    path.write_bytes(b"".join(x + b"\n" for x in out))


def _drop_last_steps(objs: list[dict], n: int) -> list[dict]:
    sids = [o["sample_id"] for o in objs if o["type"] == "sample"][-n:]
    return [o for o in objs if o.get("sample_id") not in sids]


def _unsigned(path: Path) -> None:
    """Turn a signed file into one as dpfy wrote before it signed (no key, no signatures)."""
    objs = [o for o in _objs(path) if o["type"] != "signature"]
    objs[0].pop("public_key")
    for o in objs:
        if o["type"] == "end":
            o.pop("releases")
    _rehash(path, objs)


# -- the key and the signed head ----------------------------------------------------------------


def test_close_signs_the_head_with_a_key_kept_outside_the_run_directory(tmp_path):
    path = tmp_path / "run" / "ledger.jsonl"
    path.parent.mkdir()
    ledger = _run(path)
    objs = _objs(path)
    public = objs[0]["public_key"]
    assert objs[-2]["type"] == "end" and objs[-2]["releases"] == 16
    assert objs[-1] == {"type": "signature", "lines": len(objs) - 1,
                        "signature": objs[-1]["signature"], "prev": objs[-1]["prev"]}
    key_file = signing.key_dir() / f"{ledger.run_id}.key"
    assert key_file.exists() and oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert not any(p.suffix == ".key" for p in path.parent.rglob("*"))
    v = Ledger.load(path).verification
    assert v.status == "intact and signed" and v.complete and v.public_key == public
    assert v.signed_lines == len(objs) - 1 and v.signed_head == objs[-1]["prev"]
    assert public in v.describe()
    # the public key alone verifies the signed head; another key does not
    assert signing.signature_holds(public, ledger.run_id, v.signed_lines, v.signed_head,
                                   objs[-1]["signature"])
    other = _run(tmp_path / "other.jsonl", steps=1).verification.public_key
    assert not signing.signature_holds(other, ledger.run_id, v.signed_lines, v.signed_head,
                                       objs[-1]["signature"])
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp")
    assert rep.ledger_integrity["public_key"] == public and rep.ledger_integrity["complete"]
    assert rep.ledger_integrity["signed_head"] == v.signed_head
    assert rep.formal_statement.startswith("The training run satisfies")


def test_a_key_directory_inside_the_run_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFY_KEY_DIR", str(tmp_path / "keys"))
    with pytest.raises(signing.LedgerKeyError, match="inside the run directory"):
        Ledger(tmp_path / "ledger.jsonl")


def test_resume_signs_with_the_stored_key_and_a_checkpoint_signature_verifies(tmp_path,
                                                                              monkeypatch):
    path = tmp_path / "run.jsonl"
    ledger = _run(path, steps=2, close=False)
    ledger.sign()  # a checkpoint
    assert ledger.verification.signed_lines == ledger.line_count - 1
    ledger.close()
    with Ledger(path) as resumed:
        resumed.record_sum_query(resumed.record_sample(POISSON), sensitivity=1.0, noise_std=1.0)
    v = Ledger.load(path).verification
    assert v.status == "intact and signed" and v.signed_lines == v.lines - 1
    monkeypatch.setenv("DPFY_KEY_DIR", str(tmp_path.parent / "empty-keys"))
    with pytest.raises(signing.LedgerKeyError, match="not readable"):
        Ledger(path)  # no key, no appending to a signed file


# -- attacks ------------------------------------------------------------------------------------


def test_dropping_the_last_6_of_16_steps_and_rehashing_the_tail_is_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path)
    _rehash(path, _drop_last_steps(_objs(path), 6))
    with pytest.raises(LedgerIntegrityError, match="signature of the chain head does not hold"):
        Ledger.load(path)
    assert Ledger.verify(path).status == "broken"


def test_raising_the_last_release_noise_and_rehashing_is_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path)
    objs = _objs(path)
    last = max(i for i, o in enumerate(objs) if o["type"] == "sum_query")
    objs[last]["noise_std"] = 50.0
    _rehash(path, objs)
    with pytest.raises(LedgerIntegrityError, match="signature of the chain head does not hold"):
        Ledger.load(path)


def test_removing_the_signature_reads_as_incomplete_everywhere(tmp_path, capsys):
    from dpfy.cli import main

    path = tmp_path / "ledger.jsonl"
    _run(path)
    path.write_bytes(b"".join(x + b"\n" for x in path.read_bytes().split(b"\n")[:-2]))
    v = Ledger.load(path).verification
    assert v.status == "intact, open or crash-cut" and not v.complete
    assert "not signed" in v.reason
    assert main(["report", str(path), "--delta", "1e-5", "--method", "rdp",
                 "--no-figures"]) == 0
    out = capsys.readouterr().out
    assert "Incomplete: epsilon so far" in out and "satisfies" not in out
    assert "**Incomplete: epsilon so far" in (tmp_path / "report.md").read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["formal_statement"].startswith("Incomplete: epsilon so far")
    assert data["ledger_integrity"]["complete"] is False


def test_a_truncated_or_open_ledger_is_incomplete(tmp_path):
    path = tmp_path / "run.jsonl"
    ledger = _run(path, close=False)  # still being written
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp")
    assert rep.formal_statement.startswith("Incomplete: epsilon so far")
    assert "satisfies" not in rep.formal_statement
    ledger.close()
    lines = path.read_bytes().split(b"\n")[:-1]
    path.write_bytes(b"".join(x + b"\n" for x in lines[:8]))  # the tail cut off
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp")
    assert rep.formal_statement.startswith("Incomplete: epsilon so far")


def test_a_version_downgrade_over_hashed_lines_is_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path)
    objs = _objs(path)
    objs[0]["version"] = 1
    kept = _drop_last_steps(objs, 8)  # half the releases deleted as well
    header = {k: v for k, v in kept[0].items() if k != "public_key"}
    path.write_bytes(b"".join(json.dumps(o, separators=(",", ":")).encode() + b"\n"
                              for o in [header, *kept[1:]]))
    with pytest.raises(LedgerIntegrityError, match="line 2: .*version downgrade"):
        Ledger.load(path)
    # stripping every hash but keeping the header's key: refused at line 1
    path.write_bytes(b"".join(
        json.dumps({k: v for k, v in o.items() if k != "prev"}, separators=(",", ":")).encode()
        + b"\n" for o in kept))
    with pytest.raises(LedgerIntegrityError, match="line 1: .*names a signing key"):
        Ledger.load(path)


def test_an_unsigned_ledger_is_reported_unsigned_never_verified(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path)
    _unsigned(path)
    v = Ledger.load(path).verification
    assert v.status == "unsigned" and v.ok and not v.complete and v.public_key is None
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp")
    assert "unsigned" in rep.formal_statement and rep.ledger_integrity["complete"] is False
    assert "verified" not in rep.ledger_integrity["summary"].split("(")[0]


def test_unsigned_tail_attacks_are_caught_by_the_counts_and_the_recorded_epsilon(tmp_path):
    # without a signature, an end record that still counts 16 steps refuses the cut ...
    path = tmp_path / "run.jsonl"
    _run(path)
    _unsigned(path)
    objs = _drop_last_steps(_objs(path), 6)
    end = next(o for o in objs if o["type"] == "end")
    _rehash(path, objs)
    stale = [{**o, "samples": 16} if o["type"] == "end" else o for o in _objs(path)]
    _rehash(path, stale, recount=False)
    with pytest.raises(LedgerIntegrityError, match="end record counts 16 samples"):
        Ledger.load(path)
    assert end["samples"] == 16
    # ... and with the counts rewritten too, the recorded epsilon refuses the report
    _rehash(path, objs)
    assert Ledger.load(path).verification.status == "unsigned"
    with pytest.raises(LedgerIntegrityError, match="below the .* its writer recorded"):
        build_report(Ledger.load(path), delta=DELTA, method="rdp")
    # raising the last release's noise is refused the same way
    _run(path2 := tmp_path / "b.jsonl")
    _unsigned(path2)
    objs = _objs(path2)
    last = max(i for i, o in enumerate(objs) if o["type"] == "sum_query")
    objs[last]["noise_std"] = 50.0
    _rehash(path2, objs)
    with pytest.raises(LedgerIntegrityError, match="releases were removed or their noise"):
        build_report(Ledger.load(path2), delta=DELTA, method="pld")


def test_keys_default_to_the_user_config_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("DPFY_KEY_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert signing.key_dir() == tmp_path / "cfg" / "dpfy" / "keys"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert signing.key_dir() == Path(os.path.expanduser("~")) / ".config" / "dpfy" / "keys"


def test_dpfy_report_never_overwrites_a_report_of_another_chain_head(tmp_path, capsys):
    from dpfy.cli import main

    path = tmp_path / "ledger.jsonl"
    _run(path, steps=3)
    args = ["report", str(path), "--delta", "1e-5", "--method", "rdp", "--no-figures"]
    assert main(args) == 0
    original = (tmp_path / "report.json").read_text()
    assert main(args) == 0  # same head: rewritten in place
    assert (tmp_path / "report.json").read_text() == original
    capsys.readouterr()
    with Ledger(path) as resumed:  # the ledger moves on (or is rewritten)
        resumed.record_sum_query(resumed.record_sample(POISSON), sensitivity=1.0, noise_std=1.0)
    head = Ledger.load(path).head
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert (tmp_path / "report.json").read_text() == original
    beside = tmp_path / f"report-{head[:12]}.json"
    assert json.loads(beside.read_text())["ledger_integrity"]["head"] == head
    assert (tmp_path / f"report-{head[:12]}.md").exists()
    assert "is kept and this report is written beside it" in err
    assert f"report-{head[:12]}.md" in out.replace("\n", "")


def test_the_model_card_and_report_md_carry_the_public_key_and_signed_head(tmp_path):
    from dpfy.hf.model_card import write_model_card

    path = tmp_path / "ledger.jsonl"
    _run(path, steps=2)
    v = Ledger.load(path).verification
    card = write_model_card(tmp_path / "model", path, delta=DELTA, method="rdp").read_text()
    line = f"Ed25519 public key `{v.public_key}` signed chain head `{v.signed_head}`"
    assert line in card
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp")
    assert line in rep.to_markdown()
    _unsigned(path)
    card = write_model_card(tmp_path / "model", path, delta=DELTA, method="rdp").read_text()
    assert "Ledger signature: none (an unsigned ledger" in card


def test_a_checkpoint_signs_the_head_it_records(tmp_path):
    from dpfy.training.checkpoint import ledger_state

    path = tmp_path / "run.jsonl"
    ledger = _run(path, steps=2, close=False)
    state = ledger_state(ledger)
    last = _objs(path)[-1]
    assert last["type"] == "signature" and last["lines"] == state["lines"] - 1
    assert state["head"] == ledger.head and ledger.verification.signed_lines == last["lines"]
    ledger.close()
    assert Ledger.load(path).verification.status == "intact and signed"


def test_a_broken_ledger_loaded_for_forensics_is_headlined_broken(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path, steps=4)
    objs = _objs(path)
    objs[1]["model"] = "another model"  # an edit that keeps every release, re-hashed
    _rehash(path, objs)
    rep = build_report(Ledger.load(path, verify=False), delta=DELTA, method="rdp")
    assert rep.formal_statement.startswith("Broken ledger:")
    assert "satisfies" not in rep.formal_statement


def test_a_ledger_re_signed_with_another_key_is_refused_under_the_kept_key(tmp_path, capsys):
    # An attacker who rewrites the whole file can sign it with a key of their own: the
    # header's key then verifies it, the key kept from the release does not.
    from dpfy.cli import main

    original, forged = tmp_path / "a" / "ledger.jsonl", tmp_path / "b" / "ledger.jsonl"
    original.parent.mkdir()
    forged.parent.mkdir()
    kept = _run(original, steps=4).verification.public_key
    other = _run(forged, steps=2).verification.public_key
    assert kept and other and kept != other
    assert Ledger.load(forged).verification.status == "intact and signed"  # its own key holds
    with pytest.raises(LedgerIntegrityError, match="not the key kept apart"):
        Ledger.load(forged, public_key=kept)
    assert Ledger.load(forged, public_key=other).verification.complete
    forensic = Ledger.load(forged, verify=False, public_key=kept).verification
    assert (forensic.status, forensic.broken_line) == ("broken", 1)
    args = ["report", str(forged), "--delta", "1e-5", "--method", "rdp", "--no-figures"]
    assert main([*args, "--public-key", kept]) == 2
    err = capsys.readouterr().err.strip()
    assert "not by the key you trust, kept apart from the file" in err and "\n" not in err
    assert not (forged.parent / "report.json").exists()  # nothing written
    assert main([*args, "--public-key", "abc"]) == 2
    assert "64 lowercase hex digits" in capsys.readouterr().err
    assert main([*args, "--public-key", other]) == 0
