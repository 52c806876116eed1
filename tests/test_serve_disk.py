"""`forgetless serve` against its own disk (issue 50): a write or fsync that fails (injected, and a full tmpfs
where one can be mounted), the log deleted, replaced or truncated under the server, rollbacks as transactions
(roll back and forward again; a failed snapshot changes nothing), kept states as hashed files of their own with
a fallback from a damaged snapshot, a base of another width, log compaction and a start that streams a 100 MB
log; reads that never wait on learning and a bounded learn queue; private files, the Host allowlist and
JSON-only POSTs. Every case is on loopback (TestClient) or in-process, bounded, and stops by itself."""
import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (bash scripts/setup.sh dev or serve)")

from forgetless.errors import ForgetlessError  # noqa: E402
from forgetless.serve import store, wal  # noqa: E402
from forgetless.serve.app import make_app  # noqa: E402
from forgetless.serve.engine import KEPT, SNAPSHOT, WAL, Engine, ServeConfig, kept_name  # noqa: E402
from test_serve import (AUTH, DOCS, TEXT, TOKEN, engine, free_port, local, serve_cli, served_files,  # noqa: E402,F401
                        state_of, trained)
from tiny_models import ours  # noqa: E402

LEARN = {"canary_every": 2, "snapshot_every": 4, "screen_k": 0, "screen_low_k": 0, "screen_min_compression": 0,
         "learn_per_minute": 0, "max_canary_rise": 10}  # the screen off (the test text repeats itself)


def learn(c, docs, **extra):
    return [c.post("/v1/learn", json={"text": d, **extra}, headers=AUTH) for d in docs]


def one_line_503(r):
    assert r.status_code == 503 and "\n" not in r.json()["error"], r.text
    return r.json()["error"]


def fail_on(monkeypatch, e: Engine, name: str, times: int = 1, partial: bool = False):
    """Make os.`name` fail with ENOSPC on the log's descriptor the next `times` calls (`partial`: a write lands
    half its bytes first)."""
    real, left = getattr(os, name), [times]

    def failing(fd, *args):
        if fd == e.wal.fd and left[0] > 0:
            left[0] -= 1
            if partial and name == "write":
                real(fd, args[0][:len(args[0]) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *args)
    monkeypatch.setattr(os, name, failing)


# ---- 1. appends that fail leave no trace ----------------------------------------------------------------


@pytest.mark.parametrize("call, partial", [("write", False), ("write", True), ("fsync", False)],
                         ids=["write", "half-a-write", "fsync"])
def test_a_failed_append_is_cut_off_answered_503_and_uses_no_sequence_number(trained, tmp_path, monkeypatch, call,
                                                                             partial):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    assert [r.json()["seq"] for r in learn(c, DOCS[:2])] == [1, 2]
    before = (tmp_path / "state" / WAL).read_bytes()
    weights = state_of(e)
    fail_on(monkeypatch, e, call, partial=partial)
    error = one_line_503(learn(c, DOCS[2:3])[0])
    assert "No space left" in error and "nothing was learned" in error
    assert (tmp_path / "state" / WAL).read_bytes() == before and e.seq == 2  # cut back: no trace, no seq used
    assert all(torch.equal(v, state_of(e)[k]) for k, v in weights.items())
    assert learn(c, DOCS[3:4])[0].json()["seq"] == 3  # space is back: the next document gets the next number
    e.close()
    again = engine(trained, tmp_path / "state", **LEARN)
    assert [r["text"] for r in again.wal.records] == [DOCS[0], DOCS[1], DOCS[3]] and again.seq == 3


def test_a_write_that_cannot_be_cut_back_stops_learning_and_a_restart_keeps_every_acknowledged_document(
        trained, tmp_path, monkeypatch):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:2])
    fail_on(monkeypatch, e, "write", partial=True)
    fail_on(monkeypatch, e, "ftruncate")
    error = one_line_503(learn(c, DOCS[2:3])[0])
    assert "learning stopped" in error
    assert "learning stopped" in one_line_503(learn(c, DOCS[3:4])[0])  # nothing more is acknowledged
    assert "learning stopped" in c.get("/v1/health").json()["learning"]
    assert c.post("/v1/score", json={"text": DOCS[0]}).status_code == 200  # reads go on
    e.close()
    again = engine(trained, tmp_path / "state", **LEARN)  # the half record is a torn tail: cut off
    assert [r["text"] for r in again.wal.records] == DOCS[:2] and again.seq == 2


def test_repair_keeps_the_acknowledged_record_over_a_failed_one_under_its_number(tmp_path):
    """The log an older server left after a full disk: the failed record 3 stayed buffered and was written again
    before the acknowledged record 3."""
    path = tmp_path / WAL
    log = wal.WriteAheadLog(path)
    for seq, text in ((1, "one"), (2, "two"), (3, "answered 500"), (3, "acknowledged"), (4, "four")):
        log.write({"seq": seq, "text": text}) if seq != 3 else os.write(log.fd, (json.dumps(
            {"seq": 3, "text": text, "crc": wal.checksum({"seq": 3, "text": text})}) + "\n").encode())
        log.size = os.fstat(log.fd).st_size
    log.close()
    with pytest.raises(ForgetlessError, match="line 3 is damaged .sequence number 3 written again at line 4"):
        wal.WriteAheadLog(path)
    wal.repair(path)
    assert [r["text"] for r in wal.WriteAheadLog(path).records] == ["one", "two", "acknowledged", "four"]
    assert b"answered 500" in (tmp_path / wal.QUARANTINE).read_bytes()


def test_a_full_tmpfs_answers_503_and_loses_nothing_acknowledged(trained, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (no privilege in this container)")
    try:
        options = {**LEARN, "snapshot_every": 1000, "canary_every": 1000}
        e = engine(trained, disk / "state", **options)
        c = local(make_app(e, TOKEN))
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 40_000))  # about 40 KB left
        acknowledged, answers = [], []
        for i in range(200):  # 40 KB fill within 200 documents of 1.5 KB
            r = learn(c, [f"{i} {TEXT[i % 12 * 1500:(i % 12 + 1) * 1500]}"])[0]
            answers.append(r.status_code)
            if r.status_code == 200:
                acknowledged.append(r.json()["seq"])
            else:
                assert "No space left" in one_line_503(r)
                break
        assert answers[-1] == 503 and acknowledged == list(range(1, len(acknowledged) + 1))
        (disk / "filler").unlink()  # space returns
        assert learn(c, ["after the disk was full " + DOCS[0]])[0].json()["seq"] == len(acknowledged) + 1
        e.close()
        again = engine(trained, disk / "state", **options)
        assert [r["seq"] for r in again.wal.records] == list(range(1, len(acknowledged) + 2))
        again.close()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ---- 2. the log is the log ------------------------------------------------------------------------------


def replace_log(path):
    fresh = path.with_name("other")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)


@pytest.mark.parametrize("change, said", [
    (lambda p: p.unlink(), "was deleted"),
    (replace_log, "was replaced"),
    (lambda p: os.truncate(p, p.stat().st_size // 2), "changed size"),
    (lambda p: p.open("ab").write(b"more\n"), "changed size"),
], ids=["deleted", "replaced", "truncated", "appended-to"])
def test_the_log_changed_under_the_server_stops_acknowledging_in_one_line(trained, tmp_path, change, said):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:3])
    change(tmp_path / "state" / WAL)
    assert said in c.get("/v1/health").json()["learning"]
    for r in learn(c, DOCS[3:5], key="k"):
        assert said in one_line_503(r) and "nothing more is acknowledged" in r.json()["error"]
    assert e.seq == 3 and c.post("/v1/rollback", headers=AUTH).status_code == 503


# ---- 3. rollbacks are transactions ----------------------------------------------------------------------


def kept_bytes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((folder / KEPT).iterdir())}


def test_rolling_back_and_forward_again_restores_the_later_state_exactly(trained, tmp_path):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:4])
    at4 = state_of(e)
    learn(c, DOCS[4:8])
    at8, files = state_of(e), kept_bytes(tmp_path / "state")
    assert sorted(e.kept) == [0, 4, 8]
    back = c.post("/v1/rollback", json={"seq": 4}, headers=AUTH).json()
    assert back["restored_seq"] == 4 and all(torch.equal(v, state_of(e)[k]) for k, v in at4.items())
    forward = c.post("/v1/rollback", json={"seq": 8}, headers=AUTH).json()
    assert forward["restored_seq"] == 8 and all(torch.equal(v, state_of(e)[k]) for k, v in at8.items())
    assert kept_bytes(tmp_path / "state") == files  # no kept state was rewritten
    served = state_of(e)
    e.close()
    again = engine(trained, tmp_path / "state", **LEARN)
    assert all(torch.equal(v, state_of(again)[k]) for k, v in served.items())


def test_a_rollback_whose_snapshot_fails_changes_nothing_now_or_after_a_restart(trained, tmp_path, monkeypatch):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:6])
    served, log = state_of(e), (tmp_path / "state" / WAL).read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(store, "save_file", full)
    for body in ({}, {"seq": 4}):
        assert "nothing changed" in one_line_503(c.post("/v1/rollback", json=body, headers=AUTH))
        assert all(torch.equal(v, state_of(e)[k]) for k, v in served.items())
        assert (tmp_path / "state" / WAL).read_bytes() == log  # the rollback's record was cut off again
    monkeypatch.undo()
    e.close()
    again = engine(trained, tmp_path / "state", **LEARN)
    assert all(torch.equal(v, state_of(again)[k]) for k, v in served.items())


# ---- 4. kept states are independent and checked -----------------------------------------------------------


def corrupt(path, at=-100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_snapshot_falls_back_to_a_kept_state_and_keeps_the_acknowledged_rollbacks(trained, tmp_path):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:8])
    for target in (4, 8, 4):  # acknowledged rollbacks, the last one away from the newest kept state
        assert c.post("/v1/rollback", json={"seq": target}, headers=AUTH).status_code == 200
    learn(c, DOCS[8:10])
    served, state = state_of(e), tmp_path / "state"
    assert (state / SNAPSHOT).stat().st_ino != (state / KEPT / kept_name(8)).stat().st_ino
    manifest = json.loads((state / "manifest.json").read_text())
    assert manifest["kept"]["8"]["sha256"] == hashlib.sha256((state / KEPT / kept_name(8)).read_bytes()).hexdigest()
    e.close()
    corrupt(state / SNAPSHOT)
    again = engine(trained, state, **LEARN)
    assert str(state / SNAPSHOT) in again.recovered and "\n" not in again.recovered
    assert kept_name(8) in again.recovered
    assert all(torch.equal(v, state_of(again)[k]) for k, v in served.items())  # the 3 rollbacks were replayed
    assert again.seq == 10
    again.close()


def test_a_damaged_kept_state_is_one_line_and_no_longer_a_target(trained, tmp_path):
    e = engine(trained, tmp_path / "state", **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:8])
    corrupt(tmp_path / "state" / KEPT / kept_name(4))
    r = c.post("/v1/rollback", json={"seq": 4}, headers=AUTH)
    assert r.status_code == 422 and kept_name(4) in r.json()["error"] and "\n" not in r.json()["error"]
    assert 4 not in [k["seq"] for k in c.get("/v1/states").json()["kept"]]
    e.close()
    corrupt(tmp_path / "state" / SNAPSHOT)
    corrupt(tmp_path / "state" / KEPT / kept_name(8))
    again = engine(trained, tmp_path / "state", **LEARN)  # falls back to the first start's
    assert kept_name(8) in again.recovered and kept_name(0) in again.recovered and again.seq == 8
    again.close()


def test_a_base_of_another_width_on_restart_is_one_line(trained, tmp_path):
    e = engine(trained, tmp_path / "state", **LEARN)
    e.close()
    canary = torch.zeros(4, 17, dtype=torch.long)
    from forgetless.data.tokenizers import ByteTokenizer
    with pytest.raises(ForgetlessError, match="written for another base .*size mismatch") as info:
        Engine(ours(d=48), ByteTokenizer(), canary, 16, ServeConfig(method="full"), tmp_path / "state")
    assert "\n" not in str(info.value)
    Engine(ours(), ByteTokenizer(), canary, 16, ServeConfig(method="full"), tmp_path / "state").close()  # released


def test_a_folder_from_before_the_manifest_is_migrated_without_hard_links(trained, tmp_path):
    e = engine(trained, tmp_path / "state", **LEARN)
    learn(local(make_app(e, TOKEN)), DOCS[:4])
    e.close()
    state = tmp_path / "state"
    (state / "manifest.json").unlink()
    for seq in (0, 4):  # as an older server left them: hard links of the snapshot it wrote
        (state / KEPT / kept_name(seq)).unlink()
    os.link(state / SNAPSHOT, state / KEPT / kept_name(4))
    again = engine(trained, state, **LEARN)
    assert sorted(again.kept) == [4] and (state / KEPT / kept_name(4)).stat().st_nlink == 1
    again.close()


# ---- 5. bounded log and memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("retention", ["archive", "drop"])
def test_the_log_is_compacted_after_snapshots(trained, tmp_path, retention):
    options = {**LEARN, "keep_states": 2, "log_retention": retention}
    e = engine(trained, tmp_path / "state", **options)
    learn(local(make_app(e, TOKEN)), DOCS[:14])
    served = state_of(e)
    e.close()
    state = tmp_path / "state"
    assert sorted(e.kept) == [0, 8, 12]
    logged = [json.loads(line)["seq"] for line in (state / WAL).read_bytes().splitlines()]
    assert logged == list(range(9, 15))  # the documents before the oldest kept state (8) left the log
    archived = sorted((state / wal.ARCHIVE).glob("*.jsonl"))
    if retention == "archive":
        assert [json.loads(line)["seq"] for p in archived for line in p.read_bytes().splitlines()] == list(range(1, 9))
    else:
        assert not archived
    again = engine(trained, state, **options)
    assert all(torch.equal(v, state_of(again)[k]) for k, v in served.items())
    assert [r["seq"] for r in again.wal.records] == list(range(1 if retention == "archive" else 9, 15))
    again.close()


MEMORY = """
import sys, time
from forgetless.serve.wal import WriteAheadLog
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
before = hwm()
log = WriteAheadLog(sys.argv[1])
n = sum(1 for _ in log.replay(0))
print(n, hwm() - before)
"""


def test_a_100_mb_log_starts_in_under_50_mb_more_memory(tmp_path):
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc (Linux) to read the peak memory")
    path, text = tmp_path / WAL, "x y z " * 10_000  # 60 KB documents
    with open(path, "wb") as f:
        for seq in range(1, 1701):
            record = {"seq": seq, "text": f"{seq} {text}"}
            f.write((json.dumps({**record, "crc": wal.checksum(record)}) + "\n").encode())
    assert path.stat().st_size > 100e6
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", MEMORY, str(path)], capture_output=True, text=True, timeout=300,
                         env=env)
    count, grown = map(int, out.stdout.split())
    assert count == 1700 and grown < 50, (count, grown)


# ---- 6. reads never wait on learning -----------------------------------------------------------------------


def test_reads_take_no_lock_and_a_full_learn_queue_is_503_with_retry_after(trained, tmp_path):
    e = engine(trained, tmp_path / "state", **LEARN, max_queued=1)
    c = local(make_app(e, TOKEN))
    answers = []
    with e.lock:  # the learner is busy: the queued learn waits for it
        waiting = threading.Thread(target=lambda: answers.append(learn(c, DOCS[:1])[0]))
        waiting.start()
        for _ in range(200):  # until the learn is queued (bounded: 10 s)
            if c.get("/v1/health").json()["queued"] == 1:
                break
            time.sleep(0.05)
        for path in ("/v1/health", "/v1/metrics", "/v1/states", "/v1/stats", "/"):
            assert c.get(path).status_code == 200  # answered while the engine's lock is held
        full = learn(c, DOCS[1:2])[0]
        assert one_line_503(full) and full.headers["Retry-After"].isdigit()
        assert c.post("/v1/snapshot", headers=AUTH).status_code == 503
    waiting.join(60)
    assert answers[0].status_code == 200 and answers[0].json()["seq"] == 1


# ---- 7. private by default ------------------------------------------------------------------------------------


def test_the_state_folder_and_its_files_are_private(trained, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    e = engine(trained, state, **LEARN)
    c = local(make_app(e, TOKEN))
    learn(c, DOCS[:8])
    e.close()
    (state / WAL).write_bytes((state / WAL).read_bytes() + b"garbage\n")
    wal.repair(state / WAL)
    assert state.stat().st_mode & 0o777 == 0o700
    files = [p for p in state.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {WAL, wal.QUARANTINE, SNAPSHOT, "manifest.json", kept_name(4)}
    assert {str(p.relative_to(state)): oct(p.stat().st_mode & 0o777) for p in files if p.stat().st_mode & 0o077} == {}


def test_only_allowed_hosts_and_json_bodies_are_served(trained, tmp_path):
    c = local(make_app(engine(trained, tmp_path / "state", **LEARN), TOKEN))
    evil = c.get("/v1/health", headers={"Host": "evil.example"})
    assert evil.status_code == 400 and "evil.example" in evil.json()["error"] and "--allowed-hosts" in evil.json()["error"]
    for host in ("localhost:8000", "127.0.0.1:1", "[::1]:8000"):
        assert c.get("/v1/health", headers={"Host": host}).status_code == 200
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        r = c.post("/v1/score", content=b'{"text": "hello there"}', headers={"Content-Type": kind} if kind else {})
        assert r.status_code == 415 and "application/json" in r.json()["error"]
    assert c.post("/v1/score", json={"text": "hello there"}).status_code == 200
    anywhere = local(make_app(engine(trained, tmp_path / "other", **LEARN), TOKEN, ("*",)))
    assert anywhere.get("/v1/health", headers={"Host": "myserver.lan"}).status_code == 200


def test_a_non_loopback_host_needs_allowed_hosts():
    from forgetless.cli import allowed
    with pytest.raises(ForgetlessError, match="--host 0.0.0.0 is not loopback: give --allowed-hosts"):
        allowed("0.0.0.0", None)
    assert allowed("0.0.0.0", "a.lan, 10.0.0.5") == ("a.lan", "10.0.0.5")
    assert "localhost" in allowed("127.0.0.1", None) and "::1" in allowed("::1", None)


# ---- 9. every misconfiguration a one-line error ----------------------------------------------------------------


def startup_cases(tmp_path, base, canary, token, trained):
    """(name, extra serve arguments, what the one line must say), each preparing what it needs."""
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint at all")
    (tmp_path / "wide").mkdir()
    wide = served_files(ours(d=48).state_dict(), tmp_path / "wide", ours(d=48).config)[0]
    open_token = tmp_path / "open-token"
    open_token.write_text(TOKEN)
    open_token.chmod(0o644)
    Engine(ours(), __import__("forgetless.data.tokenizers", fromlist=["ByteTokenizer"]).ByteTokenizer(),
           torch.zeros(4, 17, dtype=torch.long), 16, ServeConfig(method="full"), tmp_path / "full-state").close()
    (tmp_path / "tiny.txt").write_text("O speak.")  # as a held-out canary read whole: shorter than one window
    (tmp_path / "bad-manifest").mkdir()
    (tmp_path / "bad-manifest" / "manifest.json").write_text("{not json")
    return [
        ("no base", ["--base", tmp_path / "missing.safetensors"], "does not exist"),
        ("garbage base", ["--base", tmp_path / "garbage.safetensors"], "corrupt or truncated"),
        ("unknown method", ["--serve-method", "nonsense"], "nonsense"),
        ("another method's state", ["--state-dir", tmp_path / "full-state"], "another method"),
        ("another width's state", ["--base", wide, "--state-dir", tmp_path / "full-state", "--serve-method", "full"],
         "another base"),
        ("damaged manifest", ["--state-dir", tmp_path / "bad-manifest"], "manifest.json is damaged"),
        ("state dir cannot be made", ["--state-dir", "/proc/forgetless/state"], "cannot be made or written"),
        ("readable token file", ["--token-file", open_token], "chmod 600"),
        ("missing token file", ["--token-file", tmp_path / "nothing"], "does not exist"),
        ("port 0", ["--port", 0], "not a TCP port"),
        ("port 65536", ["--port", 65536], "not a TCP port"),
        ("port -1", ["--port", -1], "not a TCP port"),
        ("port 2**70", ["--port", 2 ** 70], "not a TCP port"),
        ("unknown host", ["--host", "no-such-host.invalid", "--allowed-hosts", "x"], "cannot listen"),
        ("public host without names", ["--host", "0.0.0.0"], "--allowed-hosts"),
        ("keep no states", ["--serve-keep-states", 0], "keep_states must be positive"),
        ("no queue", ["--serve-max-queued", 0], "max_queued must be positive"),
        ("bad retention", ["--serve-log-retention", "forever"], "archive or drop"),
        ("NaN screen", ["--serve-screen-low-k", "nan"], "finite number"),
        ("negative compression", ["--serve-screen-min-compression", -1], "finite number"),
        ("two methods", ["--serve-method", "lora,full"], "takes one method spec"),
        ("a joint method", ["--serve-method", "mtl"], "(joint)"),
        ("a method acting at task end", ["--serve-method", "wise-ft"], "cannot learn online"),
        ("mixing with a held-out canary", ["--serve-method", "distill", "--held-out-canary"], "give --retain OLD"),
        ("mix of 1", ["--serve-mix", 1], "serve.mix must be in [0, 1)"),
        ("missing retained file", ["--retain", tmp_path / "old.txt"], "no such file"),
        ("a tiny held-out canary", ["--canary", tmp_path / "tiny.txt", "--held-out-canary"], "fewer than one window"),
    ]


def test_every_startup_misconfiguration_is_one_line(trained, tmp_path):
    base, canary, token = served_files(trained, tmp_path)
    for name, extra, said in startup_cases(tmp_path, base, canary, token, trained):
        args = {"--base": base, "--canary": canary, "--state-dir": tmp_path / "state", "--token-file": token,
                "--port": free_port()}
        flat = [a for k, v in args.items() if k not in extra for a in (k, v)] + extra
        r = serve_cli(*flat)
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and said in lines[0], (name, r.exit_code, r.output, r.exception)
