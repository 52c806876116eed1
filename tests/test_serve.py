"""`forgetless serve`: auth, bad input, rate limit, rollback on a poisoned stream, no torn reads under
concurrent learn + score, streamed generation, metrics, the dashboard's stats and the page itself in headless
Chromium, a write-ahead-log replay after `kill -9` that ends in the same weights as an uninterrupted server; the
log's checksums, refusal of damaged lines and repair, idempotency keys, one server per state folder, token
files, CLI errors, and a one-line 4xx for every bad body of every endpoint."""
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (bash scripts/setup.sh dev or serve)")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from forgetless.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from forgetless.continual.learner import chunk_windows  # noqa: E402
from forgetless.data.tokenizers import ByteTokenizer  # noqa: E402
from forgetless.errors import ForgetlessError  # noqa: E402
from forgetless.serve import wal  # noqa: E402
from forgetless.serve.app import load_token, make_app  # noqa: E402
from forgetless.serve.engine import SNAPSHOT, WAL, Engine, ServeConfig  # noqa: E402
from tiny_models import ours  # noqa: E402

TOKEN = "s3cret-s3cret-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}
LINES = [f"{['ROMEO', 'JULIET', 'NURSE'][i % 3]}:\nO speak again, bright angel, line {i}; the night is young.\n"
         for i in range(300)]
TEXT = "".join(LINES)
DOCS = ["".join(LINES[i:i + 3]) for i in range(0, 60, 3)]


@pytest.fixture(scope="module")
def trained():
    """A tiny GPT (context 16) trained a little on TEXT: a canary loss well below a random model's."""
    model = ours()
    ids = ByteTokenizer().encode(TEXT.encode())
    windows = chunk_windows(ids, 16)  # (W, 17)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        batch = windows[torch.randint(len(windows), (16,), generator=g)]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def engine(trained, state_dir, mix_from=None, **options) -> Engine:
    model = ours()
    model.load_state_dict(trained)
    canary = chunk_windows(ByteTokenizer().encode(TEXT[-3000:].encode()), 16)[:16]
    cfg = ServeConfig(**{"method": "full", "lr": 3e-3, "canary_every": 2, "snapshot_every": 4, **options})
    return Engine(model, ByteTokenizer(), canary, 16, cfg, state_dir, mix_from)


def local(app) -> TestClient:
    """A client whose requests name localhost (the server refuses other Host names by default)."""
    return TestClient(app, base_url="http://localhost")


def client(trained, tmp_path, token=TOKEN, **options) -> TestClient:
    return local(make_app(engine(trained, tmp_path / "state", **options), token))


def test_learning_needs_the_token(trained, tmp_path):
    c = client(trained, tmp_path)
    assert c.post("/v1/learn", json={"text": DOCS[0]}).status_code == 401
    wrong = c.post("/v1/learn", json={"text": DOCS[0]}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "Bearer" in wrong.json()["error"]
    ok = c.post("/v1/learn", json={"text": DOCS[0]}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["seq"] == 1
    assert c.post("/v1/snapshot").status_code == 401 and c.post("/v1/rollback").status_code == 401
    assert c.post("/v1/score", json={"text": DOCS[0]}).status_code == 200  # reading needs no token
    off = client(trained, tmp_path / "off", token=None).post("/v1/learn", json={"text": DOCS[0]}, headers=AUTH)
    assert off.status_code == 403 and "FORGETLESS_SERVE_TOKEN" in off.json()["error"]


@pytest.mark.parametrize("body, status, reason", [
    (b'{"text": "caf\xe9 au lait"}', 400, "not valid UTF-8 JSON"),
    (b'{"text": ', 400, "not valid UTF-8 JSON"),
    (b'{"text": "   "}', 422, "empty"),
    (b'{"text": "' + b"a" * 3000 + b'"}', 413, "more than the limit"),
    (b'{"text": "hello", "lr": 1}', 422, "unknown field 'lr'"),
    (b'{"txt": "hello"}', 422, "unknown field 'txt'"),
    (b'{}', 422, "missing field 'text'"),
], ids=["latin-1", "not-json", "empty", "oversize", "unknown-field", "misspelt-field", "missing-field"])
def test_bad_input_is_a_one_line_4xx(trained, tmp_path, body, status, reason):
    c = client(trained, tmp_path, max_doc_bytes=2000)
    r = c.post("/v1/learn", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status and reason in r.json()["error"] and "\n" not in r.json()["error"]
    assert c.get("/v1/health").json()["seq"] == 0  # nothing was learned or logged


def test_rate_limit_on_learn(trained, tmp_path):
    c = client(trained, tmp_path, learn_per_minute=2)
    assert [c.post("/v1/learn", json={"text": d}, headers=AUTH).status_code for d in DOCS[:3]] == [200, 200, 429]
    assert 'forgetless_learn_rejected_total{reason="rate"} 1' in c.get("/v1/metrics").text


def test_rollback_fires_on_a_poisoned_stream_and_restores_the_canary(trained, tmp_path):
    e = engine(trained, tmp_path / "state", lr=1e-3, max_canary_rise=0.05, screen_k=0, screen_max_entropy=8)  # canary alone
    c = local(make_app(e, TOKEN))
    for doc in DOCS[:4]:  # good text: the canary stays within bounds
        assert not c.post("/v1/learn", json={"text": doc}, headers=AUTH).json()["rolled_back"]
    rng = random.Random(0)
    for _ in range(10):  # random bytes
        good = e.good["meta"]["canary"]
        reply = c.post("/v1/learn", json={"text": "".join(chr(rng.randrange(256)) for _ in range(400))},
                       headers=AUTH).json()
        if reply["rolled_back"]:
            break
    assert reply["rolled_back"] and reply["canary_loss"] == good <= e.reference + 0.05
    assert e.canary_loss() == good and e.seq > e.good["meta"]["seq"] >= 4
    assert "forgetless_rollbacks_total 1" in c.get("/v1/metrics").text
    stats = c.get("/v1/stats").json()
    assert stats["rollbacks"] == [[e.seq, e.seq - e.good["meta"]["seq"]]] and stats["canary"][-1] == [e.seq, good]


def test_no_torn_reads_under_concurrent_learn_and_score(trained, tmp_path):
    probe, docs = DOCS[-1], DOCS[:6]
    reference = engine(trained, tmp_path / "reference", canary_every=100, snapshot_every=100)
    expected = {0: reference.score(probe)["loss"]}
    for doc in docs:
        seq = reference.learn(doc)["seq"]
        expected[seq] = reference.score(probe)["loss"]
    c = client(trained, tmp_path, canary_every=100, snapshot_every=100)
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            r = c.post("/v1/score", json={"text": probe}).json()
            seen.append((r["version"], r["loss"]))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for doc in docs:
        assert c.post("/v1/learn", json={"text": doc}, headers=AUTH).status_code == 200
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join()
    assert len({v for v, _ in seen}) > 1
    bad = [(v, loss, expected[v]) for v, loss in seen if loss != expected[v]]
    assert not bad, (bad[:5], len(bad), len(seen))


def test_generate_streams_and_metrics_are_prometheus_text(trained, tmp_path):
    c = client(trained, tmp_path)
    with c.stream("POST", "/v1/generate", json={"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}) as r:
        pieces = list(r.iter_text())
    assert r.status_code == 200 and 1 <= len("".join(pieces)) <= 12
    again = c.post("/v1/generate", json={"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}).text
    assert again == "".join(pieces)  # greedy: the same text
    text = c.get("/v1/metrics").text
    assert "# TYPE forgetless_generate_requests_total counter" in text and "forgetless_canary_loss " in text
    assert c.get("/v1/health").json()["status"] == "ok"


# ---- the dashboard ----------------------------------------------------------------------------------
ROUTED = "apn-retrofit[lr=0.01]"  # a routed method (patch usage) whose canary fails within a few random documents


def traffic(post, n_docs: int = 6) -> int:
    """Good documents, two refusals, a score, then random bytes until a rollback; returns the last sequence number."""
    for doc in DOCS[:n_docs]:
        assert post("/v1/learn", json={"text": doc}, headers=AUTH).status_code == 200
    assert post("/v1/learn", json={"text": " "}, headers=AUTH).status_code == 422
    assert post("/v1/learn", json={"text": DOCS[0]}).status_code == 401
    assert post("/v1/score", json={"text": DOCS[-1]}).status_code == 200
    rng = random.Random(0)
    for _ in range(10):
        reply = post("/v1/learn", json={"text": "".join(chr(rng.randrange(256)) for _ in range(400))}, headers=AUTH)
        if reply.json()["rolled_back"]:
            return reply.json()["seq"]
    raise AssertionError("no rollback on random bytes")


def test_stats_feed_the_dashboard(trained, tmp_path):
    c = client(trained, tmp_path, method=ROUTED, screen_k=0, screen_max_entropy=8)  # random bytes reach the canary
    page = c.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/stats" in page.text and "http" not in page.text.replace("http://www.w3.org/2000/svg", "")  # no CDN
    empty = c.get("/v1/stats").json()
    assert empty["prequential"] == [] and empty["prequential_mean"] is None  # NaN is null in JSON
    seq = traffic(c.post)
    s = c.get("/v1/stats").json()
    assert [p[0] for p in s["prequential"]] == list(range(1, seq + 1))
    assert [p[0] for p in s["canary"]][:3] == [2, 4, 6] and s["rollbacks"][0][0] == seq
    assert s["counters"]["accepted"] == seq and s["counters"]["rollbacks"] == 1 and s["counters"]["score"] == 1
    assert s["rejected"] == {"auth": 1, "empty": 1} and s["canary_limit"] == s["canary_reference"] + 0.05
    assert len(s["usage"]) == 2 and all(len(row) == 256 and abs(sum(row) - 1) < 1e-4 for row in s["usage"])
    assert "forgetless_learn_accepted_total" in c.get("/v1/metrics").text  # Prometheus text as before
    assert client(trained, tmp_path / "dense").get("/v1/stats").json()["usage"] is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium():
    """Selenium driving Debian's headless chromium (skips with the reason when either is missing)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium "
                                    "(bash scripts/setup.sh dev)")
    browser, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("the browser test needs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver; bash scripts/setup.sh dev installs them when run as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the viewport (headless clamps the window)
                            {"width": 1200, "height": 600, "deviceScaleFactor": 1, "mobile": False})
    return browser


@contextlib.contextmanager
def served(app):
    """`app` under uvicorn on a free loopback port, in a thread; yields its URL."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("uvicorn did not start within 30 s")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_dashboard_in_headless_chromium(trained, tmp_path):
    """Load the page after some traffic: every chart shows the data, and it follows new documents live.
    FORGETLESS_DASHBOARD_PNG=docs/figures/serve/dashboard.png also keeps the screenshot there."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser = chromium()
    try:
        with served(make_app(engine(trained, tmp_path / "state", method=ROUTED, screen_k=0, screen_max_entropy=8), TOKEN)) as url:
            with httpx.Client(base_url=url, timeout=60) as http:
                seq = traffic(http.post)
                browser.get(f"{url}/?every=300")
                points = lambda chart: int(browser.find_element(By.ID, chart).get_attribute("data-points"))  # noqa: E731
                WebDriverWait(browser, 30).until(lambda _: points("prequential") == seq)
                stats = http.get("/v1/stats").json()
                line = browser.find_element(By.CSS_SELECTOR, "#prequential polyline").get_attribute("points")
                assert len(line.split()) == seq
                assert points("canary") == len(stats["canary"]) > 0
                assert len(browser.find_elements(By.CSS_SELECTOR, "#canary .mark")) == 1  # the rollback
                assert len(browser.find_elements(By.CSS_SELECTOR, "#canary .ref")) == 2   # reference, limit
                bars = browser.find_element(By.ID, "updates").text
                assert "accepted" in bars and "refused: empty" in bars and "refused: auth" in bars and str(seq) in bars
                assert len(browser.find_elements(By.CSS_SELECTOR, "#usage rect")) == 2 * 256
                assert ROUTED in browser.find_element(By.ID, "status").text
                assert http.post("/v1/learn", json={"text": DOCS[7]}, headers=AUTH).status_code == 200
                WebDriverWait(browser, 30).until(lambda _: points("prequential") == seq + 1)  # live
                shot = tmp_path / "dashboard.png"
                assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:4] == b"\x89PNG"
                if os.environ.get("FORGETLESS_DASHBOARD_PNG"):
                    shutil.copy(shot, os.environ["FORGETLESS_DASHBOARD_PNG"])
    finally:
        browser.quit()


# ---- durability: a real server killed with SIGKILL --------------------------------------------------


def serve_command(base, canary, state_dir, token_file, port) -> list[str]:
    args = [sys.executable, "-m", "forgetless", "serve", "--base", base, "--canary", canary, "--canary-windows", "8",
            "--state-dir", state_dir, "--token-file", token_file, "--port", port, "--serve-method", "full",
            "--serve-lr", "1e-3", "--serve-canary-every", "2", "--serve-snapshot-every", "4"]
    return [str(a) for a in args]


def start_server(base, canary, state_dir, token_file, *extra):
    return launched(serve_command(base, canary, state_dir, token_file, free_port()) + [str(a) for a in extra])


def launched(command: list[str], seconds: float = 60):
    """The `forgetless serve` `command` (its --port on loopback, 1 torch thread) once it answers /v1/health
    (within `seconds`): (process, URL)."""
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/v1/health", timeout=1)
            return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read().decode()[-2000:]) from None
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start")


def learn(url, docs):
    for doc in docs:
        r = httpx.post(f"{url}/v1/learn", json={"text": doc}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text


def final_state(url, state_dir):
    assert httpx.post(f"{url}/v1/snapshot", headers=AUTH, timeout=60).status_code == 200
    return load_checkpoint(state_dir / SNAPSHOT)[0]


def served_files(weights: dict, folder, config=None):
    """A base checkpoint of `weights` (a model of `config`, default `ours()`'s), its canary text and a private token
    file in `folder`, as `forgetless serve` takes them."""
    base, canary, token_file = folder / "base.safetensors", folder / "canary.txt", folder / "token"
    save_checkpoint(base, {f"model.{k}": v for k, v in weights.items()},
                    {"kind": "base", "model_config": (config or ours().config).to_dict(), "tokenizer": {"kind": "bytes"},
                     "domain": str(canary)})
    canary.write_text(TEXT)
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return base, canary, token_file


def test_wal_replay_after_kill_9_gives_the_same_weights_and_a_second_server_is_refused(trained, tmp_path):
    base, canary, token_file = served_files(trained, tmp_path)
    docs = DOCS[:7]
    proc, url = start_server(base, canary, tmp_path / "whole", token_file)
    try:
        learn(url, docs)
        whole = final_state(url, tmp_path / "whole")
    finally:
        proc.kill()
    proc, url = start_server(base, canary, tmp_path / "killed", token_file)
    learn(url, docs[:5])  # snapshot at document 4; document 5 only in the log
    log = (tmp_path / "killed" / WAL).read_bytes()
    second = subprocess.run(serve_command(base, canary, tmp_path / "killed", token_file, free_port()),
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert second.returncode == 2 and "in use by another forgetless serve" in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and (tmp_path / "killed" / WAL).read_bytes() == log
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc, url = start_server(base, canary, tmp_path / "killed", token_file)
    try:
        health = httpx.get(f"{url}/v1/health").json()
        assert health["seq"] == 5 and health["snapshot_seq"] == 4
        learn(url, docs[5:])
        resumed = final_state(url, tmp_path / "killed")
    finally:
        proc.kill()
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole if not k.startswith("rng."))


def test_a_torn_last_log_line_is_cut_off(tmp_path):
    from forgetless.serve.wal import WriteAheadLog
    wal = WriteAheadLog(tmp_path / "wal.jsonl")
    wal.append(1, "first")
    wal.append(2, "second ü")
    wal.close()
    with open(tmp_path / "wal.jsonl", "ab") as f:
        f.write(b'{"seq": 3, "te')  # a crash mid-write
    again = WriteAheadLog(tmp_path / "wal.jsonl")
    assert [r["seq"] for r in again.records] == [1, 2] and again.after(1) == [{"seq": 2, "text": "second ü"}]
    again.append(3, "third")
    again.close()
    assert [r["seq"] for r in WriteAheadLog(tmp_path / "wal.jsonl").records] == [1, 2, 3]


# ---- the log: checksums, refusal naming the line, repair, legacy lines, idempotency keys -------------


def written_log(path, n=7) -> list[bytes]:
    log = wal.WriteAheadLog(path)
    for seq in range(1, n + 1):
        log.append(seq, f"document {seq} é", key=f"k{seq}" if seq % 2 else None)
    log.close()
    return path.read_bytes().splitlines(keepends=True)


def test_a_damaged_line_stops_the_start_naming_it_and_repair_keeps_every_good_line(tmp_path):
    path = tmp_path / "wal.jsonl"
    lines = written_log(path)
    lines[1] = lines[1].replace(b"document 2", b"document X")  # one byte, still valid JSON
    path.write_bytes(b"".join(lines))
    with pytest.raises(ForgetlessError, match=r"line 2 is damaged \(checksum mismatch\); run forgetless serve "
                                              r"--repair --state-dir") as e:
        wal.WriteAheadLog(path)
    assert "\n" not in str(e.value) and path.read_bytes() == b"".join(lines)  # nothing cut
    assert "moved line(s) 2 (checksum mismatch)" in wal.repair(path)
    assert (tmp_path / wal.QUARANTINE).read_bytes() == lines[1]
    assert [r["seq"] for r in wal.WriteAheadLog(path).records] == [1, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("line, reason", [
    (b'{"text": "no seq"}\n', "not a {seq, text, key, format} record"),
    (b'{"seq": 3, "text": "no checksum"}\n', "no checksum"),
    (b'{"seq": 2, "text": "again", "crc": "%s"}\n' % wal.checksum({"seq": 2, "text": "again"}).encode(),
     "sequence number 2 after 7"),
    (b"\n", "not JSON"),
], ids=["no-seq", "no-checksum", "duplicate-seq", "blank"])
def test_a_well_formed_but_wrong_line_is_refused_too(tmp_path, line, reason):
    path = tmp_path / "wal.jsonl"
    path.write_bytes(b"".join(written_log(path)) + line + b'{"seq": 9, "te')
    with pytest.raises(ForgetlessError, match=f"line 8 is damaged \\({reason}\\)"):
        wal.WriteAheadLog(path)


def test_a_whole_last_record_that_lost_its_newline_is_kept(tmp_path):
    path = tmp_path / "wal.jsonl"
    lines = written_log(path)
    path.write_bytes(b"".join(lines)[:-1])
    assert [r["seq"] for r in wal.WriteAheadLog(path).records] == list(range(1, 8))
    assert path.read_bytes() == b"".join(lines)


def test_legacy_lines_without_checksums_still_load(tmp_path):
    path = tmp_path / "wal.jsonl"
    path.write_bytes(b'{"seq": 1, "text": "old one"}\n{"seq": 2, "text": "old two"}\n')  # the format before checksums
    log = wal.WriteAheadLog(path)
    log.append(3, "new")
    log.close()
    assert [r["text"] for r in wal.WriteAheadLog(path).records] == ["old one", "old two", "new"]


def test_random_corruption_never_loses_an_acknowledged_document(tmp_path):
    """One byte changed at 10 random places: the log loads whole, or names a damaged line; repair then
    keeps every record but the one or two lines the byte damaged."""
    rng, refused = random.Random(0), 0
    for trial in range(10):
        path = tmp_path / f"wal{trial}.jsonl"
        lines = written_log(path)
        data = bytearray(b"".join(lines))
        at = rng.randrange(len(data))
        hit = sum(len(b"".join(lines[:i + 1])) <= at for i in range(7)) + 1  # the line holding byte `at`
        damaged = {hit, hit + 1} if data[at] == ord("\n") and hit < 7 else {hit}
        data[at] = (data[at] + rng.randrange(1, 256)) % 256
        path.write_bytes(bytes(data))
        try:
            records = wal.WriteAheadLog(path).records
        except ForgetlessError as e:
            assert f"line {hit} is damaged" in str(e) and "--repair" in str(e)
            refused += 1
            wal.repair(path)
            records = wal.WriteAheadLog(path).records
            assert [r["seq"] for r in records] == [s for s in range(1, 8) if s not in damaged]
        else:
            assert [r["seq"] for r in records] == list(range(1, 8))  # whitespace, or the last newline
        assert all(r["text"] == f"document {r['seq']} é" for r in records)
    assert refused >= 5


def test_a_key_is_learned_once_and_a_retry_gets_the_first_answer_after_a_restart(trained, tmp_path):
    e = engine(trained, tmp_path / "state")
    c = local(make_app(e, TOKEN))
    first = [c.post("/v1/learn", json={"text": d, "key": f"k{i}"}, headers=AUTH).json() for i, d in enumerate(DOCS[:5])]
    assert c.post("/v1/learn", json={"text": DOCS[1], "key": "k1"}, headers=AUTH).json() == first[1]
    other = c.post("/v1/learn", json={"text": DOCS[2], "key": "k1"}, headers=AUTH)
    assert other.status_code == 409 and "another text" in other.json()["error"]
    assert e.seq == 5
    e.close()  # snapshot at document 4; document 5 only in the log
    again = local(make_app(engine(trained, tmp_path / "state"), TOKEN))
    assert [again.post("/v1/learn", json={"text": DOCS[i], "key": f"k{i}"}, headers=AUTH).json()
            for i in (1, 4)] == [first[1], first[4]]
    assert again.get("/v1/health").json()["seq"] == 5



def state_of(e: Engine) -> dict:
    return {k: v.clone() for k, v in e.learner.model.state_dict().items()}


def test_the_key_of_the_document_a_snapshot_was_written_at_survives_a_restart(trained, tmp_path):
    """The snapshot at document 4 is written while document 4 is learned: it must hold document 4's answer,
    since the log after the snapshot does not. A kill after the snapshot's rename, before the answer reached the
    client, left this folder: the client's retry must get the first answer, not learn the document again."""
    e = engine(trained, tmp_path / "state", max_canary_rise=1.0)
    first = [e.learn(doc, key=f"k{i}") for i, doc in enumerate(DOCS[:4])]
    assert e.snapshot_seq == 4 and first[3]["seq"] == 4
    weights = state_of(e)
    e.close()
    again = engine(trained, tmp_path / "state", max_canary_rise=1.0)
    assert again.counters["replayed"] == 0 and list(again.answers) == ["k0", "k1", "k2", "k3"]
    assert again.learn(DOCS[3], key="k3") == first[3] and again.seq == 4
    assert all(torch.equal(v, weights[k]) for k, v in state_of(again).items())
    again.close()


def test_a_kill_mid_snapshot_or_before_its_kept_link_recovers_the_uninterrupted_state(trained, tmp_path):
    """The folders a kill leaves at each step of writing the snapshot at document 4 (the log already holds
    document 4): the snapshot's temporary file not yet renamed (a restart replays documents 1-4 from the older
    snapshot 0), or renamed but not yet linked into kept/ (a restart links it). Each restart ends in the
    uninterrupted weights, answers, kept states, and leaves no temporary file."""
    whole = engine(trained, tmp_path / "whole", max_canary_rise=1.0)
    answers = [whole.learn(doc, key=f"k{i}") for i, doc in enumerate(DOCS[:4])]
    weights, kept = state_of(whole), dict(whole.kept)
    assert sorted(kept) == [0, 4]
    whole.close()

    mid = tmp_path / "mid"  # killed while writing the snapshot: documents 1-4 logged, snapshot 0 on disk
    e = engine(trained, mid, max_canary_rise=1.0)
    [e.learn(doc, key=f"k{i}") for i, doc in enumerate(DOCS[:3])]
    e.wal.append(4, DOCS[3], "k3")
    e.close()
    (mid / f".{SNAPSHOT}.tmp-4242").mkdir()  # save_checkpoint's private folder, with safetensors' own temp file
    (mid / f".{SNAPSHOT}.tmp-4242" / ".tmpAb12Cd").write_bytes(b"half a snapshot")
    (mid / f".{SNAPSHOT}.tmp-4243").write_bytes(b"half a snapshot")  # as versions before the folder left it
    (mid / "kept" / ".000000004.safetensors.tmp").write_bytes(b"")

    linked = tmp_path / "linked"  # killed after the snapshot's rename, before its kept link
    shutil.copytree(tmp_path / "whole", linked)
    (linked / "kept" / "000000004.safetensors").unlink()
    (linked / "lock").unlink()

    for folder, replayed in ((mid, 4), (linked, 0)):
        again = engine(trained, folder, max_canary_rise=1.0)
        assert again.counters["replayed"] == replayed and again.seq == again.snapshot_seq == 4
        assert [again.learn(doc, key=f"k{i}") for i, doc in enumerate(DOCS[:4])] == answers and again.seq == 4
        assert all(torch.equal(v, weights[k]) for k, v in state_of(again).items())
        assert again.kept == kept and sorted(p.name for p in (folder / "kept").iterdir()) == \
            ["000000000.safetensors", "000000004.safetensors"]
        assert not [p for p in folder.rglob(".*tmp*")]
        again.close()

# ---- one server per state folder, token file, CLI errors ---------------------------------------------


def test_a_second_server_on_the_same_folder_is_refused(trained, tmp_path):
    first = engine(trained, tmp_path / "state")
    with pytest.raises(ForgetlessError, match=f"in use by another forgetless serve \\(pid {os.getpid()}\\)"):
        engine(trained, tmp_path / "state")
    first.close()
    engine(trained, tmp_path / "state").close()


def token_file(tmp_path, content: bytes, mode=0o600):
    path = tmp_path / "token"
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("content, mode, reason", [
    (TOKEN.encode(), 0o644, "can be read by other users (mode 644); run chmod 600"),
    (b"abc\n", 0o600, "the token has 3 characters, fewer than 16"),
    (TOKEN.encode() + b"\n" + TOKEN.encode() + b"\n", 0o600, "holds more than one line"),
    (b"\xff\xfe" + TOKEN.encode(), 0o600, "is not UTF-8 text"),
    (b"\n", 0o600, "is empty"),
    ("s3cret-s3cret-s3crét".encode(), 0o600, "printable ASCII without spaces"),
], ids=["world-readable", "short", "two-lines", "not-utf8", "empty", "not-ascii"])
def test_a_bad_token_file_is_refused(tmp_path, content, mode, reason):
    with pytest.raises(ForgetlessError, match=re.escape(reason)):
        load_token(token_file(tmp_path, content, mode), "")


def test_a_good_token_file_or_variable(tmp_path):
    assert load_token(token_file(tmp_path, TOKEN.encode() + b"\n"), "") == TOKEN
    assert load_token(None, f" {TOKEN}\n") == TOKEN and load_token(None, "") is None
    with pytest.raises(ForgetlessError, match="FORGETLESS_SERVE_TOKEN: the token has 3 characters"):
        load_token(None, "abc")


def serve_cli(*args):
    from typer.testing import CliRunner

    from forgetless.cli import app
    env = {k: v for k, v in os.environ.items() if k != "FORGETLESS_SERVE_TOKEN"}
    return CliRunner().invoke(app, ["serve", *map(str, args)], env=env)


def test_serve_cli_errors_are_one_line_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("x")
    r = serve_cli("--base", tmp_path / "base", "--state-dir", tmp_path / "file")
    assert r.exit_code == 2 and "is a file; give a folder" in r.output, r.output
    r = serve_cli("--base", tmp_path / "base", "--state-dir", tmp_path / "state", "--port", 99999)
    assert r.exit_code == 2 and "--port 99999 is not a TCP port" in r.output and not (tmp_path / "state").exists()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = serve_cli("--base", tmp_path / "base", "--state-dir", tmp_path / "state", "--port", taken.getsockname()[1])
    assert r.exit_code == 2 and "cannot listen on 127.0.0.1" in r.output and not (tmp_path / "state").exists()


def test_serve_repair_cli(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    lines = written_log(state / WAL)
    (state / WAL).write_bytes(b"".join(lines[:3]) + b"garbage\n" + b"".join(lines[3:]))
    r = serve_cli("--repair", "--state-dir", state)
    assert r.exit_code == 0 and "moved line(s) 4 (not JSON)" in r.output and "kept 7 good records" in r.output
    assert (state / wal.QUARANTINE).read_bytes() == b"garbage\n" and (state / WAL).read_bytes() == b"".join(lines)
    with wal.lock_folder(state):  # a server holds the folder
        r = serve_cli("--repair", "--state-dir", state)
    assert r.exit_code == 2 and "in use by another forgetless serve" in r.output


# ---- requests: token before the body, a capped body, every bad input a one-line 4xx -------------------


def test_the_token_is_checked_before_the_body_is_read(trained, tmp_path):
    c = client(trained, tmp_path)
    r = c.post("/v1/learn", content=b"not json at all", headers={"Content-Type": "application/json"})
    assert r.status_code == 401


def test_the_body_is_capped_before_it_is_parsed(trained, tmp_path):
    c = client(trained, tmp_path, max_doc_bytes=100)  # body limit 6 x 100 + 1024 bytes
    padded = b'{"text": "a small document"' + b" " * 2000 + b"}"
    for path, headers in (("/v1/learn", AUTH), ("/v1/score", {})):
        r = c.post(path, content=padded, headers={**headers, **JSON})
        assert r.status_code == 413 and r.json()["error"].startswith("the body is over 1624 bytes"), r.text
    chunked = c.post("/v1/score", content=iter([b'{"text": "', b"a" * 1000, b"a" * 1000, b'"}']), headers=JSON)
    assert chunked.status_code == 413
    lying = c.post("/v1/score", content=b'{"text": "hi there"}', headers={"Content-Length": "99999999", **JSON})
    assert lying.status_code == 413


def test_bearer_is_case_insensitive(trained, tmp_path):
    c = client(trained, tmp_path)
    for header in (f"bearer {TOKEN}", f"BEARER  {TOKEN}"):
        assert c.post("/v1/learn", json={"text": DOCS[0]}, headers={"Authorization": header}).status_code == 200
    assert c.post("/v1/learn", json={"text": DOCS[0]}, headers={"Authorization": TOKEN}).status_code == 401


def test_refused_documents_do_not_use_up_the_rate_limit(trained, tmp_path):
    c = client(trained, tmp_path, learn_per_minute=2)
    assert [c.post("/v1/learn", json={"text": "a"}, headers=AUTH).status_code for _ in range(3)] == [422] * 3
    assert [c.post("/v1/learn", json={"text": d}, headers=AUTH).status_code for d in DOCS[:3]] == [200, 200, 429]


BAD_BODIES = {  # endpoint -> bodies that must each get a one-line 4xx
    "/v1/score": ['{"text": "\\ud800"}', '{"text": "ok \\udfff ok"}', '{"text": 5}', '{"text": null}', "[]", "null",
                  '"text"', "{}", '{"text": "hi", "x": 1}', '{"text": ["a"]}', "{", ""],
    "/v1/learn": ['{"text": "\\ud800"}', '{"text": 5}', '{"text": "a"}', '{"text": "hi", "key": ""}',
                  '{"text": "hi there", "key": 5}', '{"text": "hi there", "key": "%s"}' % ("k" * 201), "[]", "{}"],
    "/v1/generate": ['{"prompt": "\\ud800"}', '{"prompt": "hi", "seed": 18446744073709551616}',
                     '{"prompt": "hi", "seed": -1}', '{"prompt": "hi", "seed": 1.5}',
                     '{"prompt": "hi", "max_tokens": 0}',
                     '{"prompt": "hi", "max_tokens": "many"}', '{"prompt": "hi", "temperature": -1}',
                     '{"prompt": "hi", "temperature": Infinity}', '{"prompt": "hi", "temperature": NaN}',
                     '{"prompt": "hi", "temperature": 1e999}', '{"prompt": ""}', '{"text": "hi"}', "[]"],
    "/v1/publish": ['{"version": 2}', '{"path": "/tmp/x"}', "[]", '"v1"', "{"],
}


FIELDS = {"/v1/score": {"text": "a short text"}, "/v1/learn": {"text": "a short text", "key": "k"},
          "/v1/generate": {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0.5, "seed": 1},
          "/v1/rollback": {"seq": 0}, "/v1/publish": {}}
VALUES = [None, True, False, -1, 0, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 70, 10 ** 400, 1.5, -0.0, 5e-324,
          1e-300, 1e308, -1e308, "", " ", "0", "x" * 300, "\ud800", "\x00", [], {}, ["a"]]


def test_every_field_of_every_endpoint_with_any_value_is_answered_without_a_5xx(trained, tmp_path):
    c = local(make_app(engine(trained, tmp_path / "state", max_doc_bytes=200), TOKEN))
    for path, good in FIELDS.items():
        for field, value in itertools.product([*good, "other"], VALUES):
            body = json.dumps({**good, field: value})  # \ud800 as an escape
            r = c.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
            error = r.json()["error"] if r.status_code != 200 else ""
            assert r.status_code < 500 and "\n" not in error, (path, field, value, r.status_code, r.text)


def test_every_bad_input_is_a_one_line_4xx(trained, tmp_path):
    c = client(trained, tmp_path)
    for path, bodies in BAD_BODIES.items():
        for body in bodies:
            r = c.post(path, content=body.encode(), headers={**AUTH, "Content-Type": "application/json"})
            error = r.json()["error"]
            assert 400 <= r.status_code < 500 and error and "\n" not in error, (path, body, r.status_code, r.text)
    assert c.get("/v1/health").json()["seq"] == 0
    lone = c.post("/v1/score", content=b'{"text": "\\ud800"}', headers={"Content-Type": "application/json"})
    assert lone.status_code == 400 and "must be half of a surrogate pair" in lone.json()["error"]


# ---- guardrails against slow poison: the screen, kept states, the reference ---------------------------


@pytest.mark.parametrize("text, options, reason", [
    ("z" * 300, {}, "repetitive"),
    ("ab" * 150, {"screen_min_entropy": 1.5}, "low-entropy"),
], ids=["one-symbol", "low-entropy"])
def test_the_byte_screen_refuses_in_one_line_without_logging_or_using_the_rate_limit(trained, tmp_path, text, options,
                                                                                       reason):
    e = engine(trained, tmp_path / "state", learn_per_minute=2, **options)
    c = local(make_app(e, TOKEN))
    r = c.post("/v1/learn", json={"text": text}, headers=AUTH)
    assert r.status_code == 422 and r.json()["reason"] == reason, r.text
    assert r.json()["error"].startswith("document refused by the screen") and "\n" not in r.json()["error"]
    assert "--serve-screen-" in r.json()["error"] and e.seq == 0 and e.wal.records == []
    assert f'forgetless_learn_rejected_total{{reason="{reason}"}} 1' in c.get("/v1/metrics").text
    assert [c.post("/v1/learn", json={"text": d}, headers=AUTH).status_code for d in DOCS[:3]] == [200, 200, 429]


def test_the_loss_screen_refuses_an_outlier_after_its_warm_up(trained, tmp_path):
    e = engine(trained, tmp_path / "state", screen_warmup=4, screen_max_entropy=8)  # the noise reaches the loss
    c = local(make_app(e, TOKEN))
    rng = random.Random(0)
    noise = "".join(chr(rng.randrange(256)) for _ in range(400))
    assert c.post("/v1/learn", json={"text": DOCS[0]}, headers=AUTH).status_code == 200
    assert c.post("/v1/learn", json={"text": DOCS[1][::-1]}, headers=AUTH).status_code == 200  # warm-up: accepted
    for doc in DOCS[2:4]:
        assert c.post("/v1/learn", json={"text": doc}, headers=AUTH).status_code == 200
    r = c.post("/v1/learn", json={"text": noise}, headers=AUTH)
    assert r.status_code == 422 and r.json()["reason"] == "outlier" and "raise --serve-screen-k" in r.json()["error"]
    assert re.search(r"its loss [\d.]+ nats/token is above [\d.]+ = median [\d.]+ \+ 5 x spread", r.json()["error"])
    assert e.seq == 4 and len(e.recent) == 4  # not logged, not in the window
    assert c.post("/v1/learn", json={"text": DOCS[4]}, headers=AUTH).json()["seq"] == 5
    off = engine(trained, tmp_path / "off", screen_warmup=4, screen_k=0, screen_max_entropy=8)
    for doc in DOCS[:4]:
        off.learn(doc)
    assert off.learn(noise)["seq"] == 5  # screen_k 0: no loss screen


def test_the_screen_window_survives_a_restart(trained, tmp_path):
    e = engine(trained, tmp_path / "state")
    for doc in DOCS[:6]:  # snapshot at 4; 5 and 6 replayed
        e.learn(doc)
    recent = list(e.recent)
    e.close()
    again = engine(trained, tmp_path / "state")
    assert list(again.recent) == recent and len(recent) == 6


def test_rollback_reaches_any_kept_state_and_a_restart_keeps_it(trained, tmp_path):
    e = engine(trained, tmp_path / "state", keep_states=2, max_canary_rise=1.0)  # no automatic rollback
    c = local(make_app(e, TOKEN))
    weights = {}
    for i, doc in enumerate(DOCS[:12], 1):  # snapshots (kept) at 4, 8, 12
        c.post("/v1/learn", json={"text": doc}, headers=AUTH)
        weights[i] = {k: v.clone() for k, v in e.learner.model.state_dict().items()}
    states = c.get("/v1/states").json()
    assert [s["seq"] for s in states["kept"]] == [0, 8, 12]  # the first start's and the last 2
    assert states["canary_limit"] == states["canary_reference"] + 1.0 and states["seq"] == 12
    assert sorted(p.name for p in (tmp_path / "state" / "kept").iterdir()) == \
        ["000000000.safetensors", "000000008.safetensors", "000000012.safetensors"]
    missing = c.post("/v1/rollback", json={"seq": 4}, headers=AUTH)
    assert missing.status_code == 422 and "no kept state at document 4; kept: 0, 8, 12" in missing.json()["error"]
    r = c.post("/v1/rollback", json={"seq": 8}, headers=AUTH).json()
    assert r["restored_seq"] == 8 and r["seq"] == r["good_seq"] == 12
    assert all(torch.equal(v, weights[8][k]) for k, v in e.learner.model.state_dict().items())
    assert c.post("/v1/score", json={"text": DOCS[0]}).json()["version"] == 12
    c.post("/v1/learn", json={"text": DOCS[12]}, headers=AUTH)
    after = {k: v.clone() for k, v in e.learner.model.state_dict().items()}
    origin = c.post("/v1/rollback", json={"seq": 0}, headers=AUTH).json()  # as far back as the first start
    assert origin["restored_seq"] == 0 and e.canary_last == e.reference
    e.close()
    again = engine(trained, tmp_path / "state", keep_states=2, max_canary_rise=1.0)  # the rollback was written: a restart keeps it
    assert again.seq == 13 and again.canary_loss() == again.reference
    again.close()
    assert not all(torch.equal(after[k], v) for k, v in weights[8].items())


def test_the_limit_is_measured_from_the_operators_reference(trained, tmp_path):
    e = engine(trained, tmp_path / "state", canary_reference=0.5, screen_k=0)
    c = local(make_app(e, TOKEN))
    stats = c.get("/v1/stats").json()
    assert stats["canary_reference"] == 0.5 and stats["canary_limit"] == 0.55 and e.reference > 1
    replies = [c.post("/v1/learn", json={"text": d}, headers=AUTH).json() for d in DOCS[:2]]
    assert replies[1]["rolled_back"]  # the canary is far above 0.55 at the first check


@pytest.mark.parametrize("options, message", [
    ({"screen_max_symbol_share": 0}, "serve.screen_max_symbol_share must be in (0, 1]"),
    ({"screen_k": -1}, "serve.screen_k must be a finite number >= 0"),
    ({"screen_warmup": 100}, "serve.screen_warmup (100) must not exceed serve.screen_window (64)"),
    ({"keep_states": 0}, "serve.keep_states must be positive"),
])
def test_bad_screen_settings_are_one_line_errors(options, message):
    with pytest.raises(ForgetlessError, match=re.escape(message)):
        ServeConfig(**options)
