"""The dashboard's server: /api/state and /metrics against a real DHT (compared with what a separate DHT client
reads), and a live swarm in headless Chromium (a SIGKILLed peer turns stale, then offline; phone width; charts
drawn from the history). Its parts on their own: test_peer_table, test_swarm_view, test_prometheus_metrics,
test_dashboard_cli."""

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from swarm.config import load_config
from swarm.dashboard.server import Dashboard
from swarm.dashboard.swarm_view import ViewConfig
from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets
from swarm.net.records import Heartbeat, expert_holders, publish_heartbeat, read_heartbeats
from tests.conftest import ROOT, SWARM_SETTINGS, reap, start_peer, wait_for_maddr, wait_until

pytestmark = pytest.mark.timeout(240)

ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


# -- a real DHT: the dashboard serves what a separate client reads ------------------------------------------
def _get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, res.headers.get("Content-Type", ""), res.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _state(base: str) -> dict:
    return json.loads(_get(base + "api/state")[2])


def assert_agrees(state: dict, beats: dict, n_experts: int) -> None:
    """/api/state shows exactly the live records a separate DHT client reads, with the same contents."""
    live = {p["peer_id"]: p for p in state["peers"] if p["status"] != "offline"}
    assert set(live) == set(beats), (sorted(live), sorted(beats))
    for pid, (hb, _) in beats.items():
        row = live[pid]
        assert row["experts"] == sorted(hb.experts)
        if row["sent_at"] == hb.sent_at:  # the same record: every field agrees
            assert (row["step"], row["tokens"], row["loss"], row["rounds_ok"], row["state"]) == (
                hb.step,
                hb.tokens,
                hb.loss,
                hb.rounds_ok,
                hb.state,
            )
    holders = expert_holders(beats, n_experts)
    assert {x["expert"]: set(x["holders"]) for x in state["experts"]} == holders
    assert state["summary"]["uncovered"] == [e for e, h in holders.items() if not h]


def agree_with_dht(base: str, reader, run_id: str, n_experts: int, tries: int = 6) -> dict:
    """Compare until two reads meet (a record may change between the dashboard's read and ours)."""
    for i in range(tries):
        state = _state(base)
        beats = read_heartbeats(reader, run_id, timeout=10)
        try:
            assert_agrees(state, beats, n_experts)
            return state
        except AssertionError:
            if i == tries - 1:
                raise
            time.sleep(0.7)
    raise AssertionError("unreachable")


def test_dashboard_serves_what_the_dht_holds():
    from swarm.net.dht_node import start_dht, visible_maddrs

    boot = start_dht()
    dhts, board, stop = [boot], None, threading.Event()
    try:
        maddrs = visible_maddrs(boot)
        watcher, reader = start_dht(maddrs, client_mode=True), start_dht(maddrs, client_mode=True)
        alive, dies = start_dht(maddrs), start_dht(maddrs)  # each peer signs its own heartbeat
        dhts += [watcher, reader, alive, dies]
        alive_id, dies_id = alive.peer_id.to_base58(), dies.peer_id.to_base58()
        cfg = ViewConfig(run_id="dashtest", n_experts=6, poll_s=0.5, read_timeout_s=3)
        board = Dashboard.start(watcher, cfg, port=0)

        def publish(node, experts, **kw):  # period 1 s, TTL 3 s, like a peer's heartbeat
            hb = Heartbeat(experts=experts, state="training", period_s=1.0, **kw)
            assert publish_heartbeat(node, "dashtest", node.peer_id.to_base58(), hb, ttl_s=3.0)

        def keep_alive():
            step = 0
            while not stop.wait(0.5):
                step += 1
                publish(alive, [0, 1, 2], step=step, tokens=64 * step, loss=3.0, tokens_per_s=99.0)

        publish(alive, [0, 1, 2])
        publish(dies, [2, 3], step=5, rounds_ok=2, bytes_sent=1000, bytes_recv=3000)
        died_at = time.time()
        threading.Thread(target=keep_alive, daemon=True).start()
        wait_until(lambda: len(_state(board.url)["peers"]) == 2, 20, "both peers on the dashboard")
        state = agree_with_dht(board.url, reader, "dashtest", 6)
        assert {p["peer_id"]: p["status"] for p in state["peers"]}[dies_id] in ("online", "stale")
        dying = next(p for p in state["peers"] if p["peer_id"] == dies_id)
        assert dying["bytes_per_round"] == 2000 and dying["short_id"] == dies_id[-8:]

        code, ctype, body = _get(board.url + "metrics")
        assert code == 200 and ctype.startswith("text/plain") and b"swarm_experts_covered" in body

        status = lambda: {p["peer_id"]: p["status"] for p in _state(board.url)["peers"]}  # noqa: E731
        wait_until(lambda: status()[dies_id] == "stale", 10, "the silent peer stale")
        assert time.time() - died_at <= 2 * 1.0 + 1.5  # two periods after its last heartbeat (+ slack)
        wait_until(lambda: status()[dies_id] == "offline", 10, "the silent peer offline")
        assert time.time() - died_at <= 3 * 1.0 + 3.0  # once its record expired (+ polls)
        state = agree_with_dht(board.url, reader, "dashtest", 6)
        assert state["summary"]["uncovered"] == [3, 4, 5] and status()[alive_id] == "online"
        assert state["summary"]["rounds_ok"] == 2  # counted while it lived, kept after

        # the page and its assets come from the package; nothing from elsewhere
        code, ctype, page = _get(board.url)
        assert code == 200 and ctype.startswith("text/html") and b'src="/static/app.js"' in page
        for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
            code, ctype, body = _get(board.url + "static/" + name)
            body = body.replace(b"http://www.w3.org/2000/svg", b"")  # SVG's namespace name, not a fetch
            assert code == 200 and kind in ctype and b"http://" not in body and b"https://" not in body
        assert b"https://" not in page
        assert _get(board.url + "nope")[0] == 404 and _get(board.url + "static/../cli.py")[0] == 404
        code, _, body = _get(board.url + "api/state", method="HEAD")
        assert code == 200 and body == b""
    finally:
        stop.set()
        if board is not None:
            board.close()
        for d in dhts:
            d.shutdown()


# -- a live swarm in headless Chromium ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium_missing() -> str | None:
    """Install Debian's Chromium when it is not there (bounded in time). The reason to skip, or None."""
    if os.path.exists(CHROMIUM):
        return None
    if shutil.which("apt-get") is None:
        return f"{CHROMIUM} is missing and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ("apt-get install -y -q chromium", "apt-get update -q && apt-get install -y -q chromium"):
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, timeout=240)
        if os.path.exists(CHROMIUM):
            return None
    return f"{CHROMIUM} is missing and `apt-get install chromium` did not install it"


def _sync_playwright():
    """playwright's sync API; pip-installs the package when missing (it is in the `dev` extra). Never
    `playwright install`: that downloads browsers of its own; the system's Chromium is used."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        res = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "playwright"], capture_output=True, timeout=240
        )
        assert res.returncode == 0, f"pip install playwright failed: {res.stderr.decode()[-500:]}"
        importlib.invalidate_caches()
        from playwright.sync_api import sync_playwright
    return sync_playwright


def _start(cmd: list[str], log) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _peer_id(log, beats: dict) -> str:
    """The full id of the peer whose log says "peer <last 12 characters> joined run"."""
    tail = next(line.split()[1] for line in log.read_text().splitlines() if " joined run " in line)
    (full,) = [pid for pid in beats if pid.endswith(tail)]
    return full


# The points drawn and the history of the state they were drawn from, read at once (no refresh between).
CHART_POINTS = """() => {
    const points = (chart, series) => [...document.querySelectorAll(`#${chart} polyline`)]
        .filter((p) => p.dataset.series === series).reduce((n, p) => n + Number(p.dataset.points), 0);
    const h = window.dashboardState.history;
    return {loss: points("chart-loss", "mean"), loss_samples: h.loss.filter((v) => v !== null).length,
            tps: points("chart-tps", "total"), tps_samples: h.t.length};
}"""


@pytest.mark.timeout(600)  # includes installing Chromium when it is missing
def test_live_swarm_in_a_browser(tiny_config, tmp_path):
    reason = _chromium_missing()
    if reason:
        pytest.skip(reason)
    sync_playwright = _sync_playwright()
    from swarm.net.dht_node import start_dht

    ARTIFACTS.mkdir(exist_ok=True)
    procs, reader, period = [], None, 2.0  # SWARM_SETTINGS: heartbeat every 2 s
    sockets_before = p2p_sockets()
    run_id = load_config(tiny_config).run_id
    boot_port, dash_port = _free_port(), _free_port()
    try:
        boot = _start(
            [
                sys.executable,
                "-m",
                "bootstrap.main",
                "--config",
                str(tiny_config),
                "--dashboard-port",
                str(boot_port),
            ],
            tmp_path / "boot.log",
        )
        procs.append(boot)
        maddr = wait_for_maddr(tmp_path / "boot.log", boot)
        peers = [
            start_peer(
                [
                    "--config",
                    str(tiny_config),
                    "--initial-peers",
                    maddr,
                    "--run-dir",
                    str(tmp_path / f"p{i}"),
                    "--max-minutes",
                    "1.5",
                    *SWARM_SETTINGS,
                    "--set",
                    "train.max_steps=100000",  # training until stopped, not done after 100 steps
                ],
                tmp_path / f"p{i}.err",
            )
            for i in range(2)
        ]
        procs += peers
        dash = _start(
            [
                sys.executable,
                "-m",
                "swarm.dashboard.cli",
                "--initial-peers",
                maddr,
                "--config",
                str(tiny_config),
                "--port",
                str(dash_port),
                "--poll-s",
                "1",
            ],
            tmp_path / "dash.log",
        )
        procs.append(dash)
        base = f"http://127.0.0.1:{dash_port}/"
        reader = start_dht([maddr], client_mode=True)  # a separate client: what anyone can read

        def ready() -> bool:
            with contextlib.suppress(OSError, ValueError):
                st = _state(base)
                losses = [v for v in st["history"]["loss"] if v is not None]
                return st["summary"]["peers_online"] == 2 and len(losses) >= 3
            return False

        wait_until(ready, 150, f"two training peers on the dashboard: {(tmp_path / 'dash.log').read_text()}")
        state = agree_with_dht(base, reader, run_id, 8)
        assert agree_with_dht(f"http://127.0.0.1:{boot_port}/", reader, run_id, 8)  # the bootstrap's page
        assert state["summary"]["experts_covered"] == 8  # 2 peers x 4 experts of 8

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []  # script errors and CSP violations (nothing may load from elsewhere)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(base)
            # a function, not an expression: an expression string is eval'ed in the page, which its CSP forbids
            page.wait_for_function(
                "() => document.querySelectorAll('#peers tbody tr[data-status=online]').length === 2",
                timeout=20000,
            )
            shown = page.evaluate(
                """() => Object.fromEntries([...document.querySelectorAll('#peers tbody tr[data-peer]')]
                    .map((tr) => [tr.dataset.peer, tr.querySelector('td.experts').textContent]))"""
            )
            beats = read_heartbeats(reader, run_id, timeout=10)
            assert shown == {pid: ", ".join(map(str, sorted(hb.experts))) for pid, (hb, _) in beats.items()}
            assert page.locator("#s-covered").inner_text() == "8 / 8"
            # any online peer is an entry point: its own addresses, listed as its heartbeat names them
            listed = page.evaluate(
                "() => [...document.querySelectorAll('#entry-points li[data-peer] code')].map((c) => c.textContent)"
            )
            addrs = [a for pid, (hb, _) in beats.items() for a in hb.addrs]
            assert listed and sorted(listed) == sorted(addrs), (listed, addrs)
            assert all(a.endswith(f"/p2p/{pid}") for pid, (hb, _) in beats.items() for a in hb.addrs)
            # the charts draw the history: as many points as the page's state has samples
            drawn = page.evaluate(CHART_POINTS)
            assert (
                drawn["loss"] == drawn["loss_samples"] >= 2 and drawn["tps"] == drawn["tps_samples"] >= 2
            ), drawn
            shot = ARTIFACTS / "dashboard-1280x800.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            phone = browser.new_page(viewport={"width": 390, "height": 844})
            phone.goto(base)
            phone.wait_for_selector("#peers tbody tr[data-status=online]")
            phone.wait_for_selector("#chart-tps polyline", state="attached")
            widths = phone.evaluate(
                """() => ({page: document.documentElement.scrollWidth, view: window.innerWidth,
                    table: document.querySelector('#peers').scrollWidth,
                    wrap: document.querySelector('#peers').parentElement.clientWidth,
                    overflow: getComputedStyle(document.querySelector('#peers').parentElement).overflowX})"""
            )
            assert widths["page"] <= widths["view"], widths  # no horizontal page scroll
            assert widths["table"] > widths["wrap"] and widths["overflow"] == "auto", (
                widths
            )  # the table scrolls
            shot = ARTIFACTS / "dashboard-390x844.png"
            phone.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            # a crash: SIGKILL the peer's whole process group
            victim, victim_id = peers[1], _peer_id(tmp_path / "p1.err", beats)
            os.killpg(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            victim.wait(timeout=30)
            row = f"#peers tbody tr[data-peer='{victim_id}']"
            page.wait_for_selector(f"{row}[data-status=stale]", timeout=int(1000 * (2 * period + 5)))
            to_stale = time.monotonic() - killed
            page.wait_for_selector(f"{row}[data-status=offline]", timeout=int(1000 * (3 * period + 10)))
            to_offline = time.monotonic() - killed
            print(f"killed peer: stale after {to_stale:.1f} s, offline after {to_offline:.1f} s")
            # the last heartbeat came before the kill: stale within two periods of it, offline once its record
            # (TTL three periods) expired; the page re-judges ages every 250 ms between fetches (+ slack)
            assert to_stale <= 2 * period + 1.0, to_stale
            assert to_offline <= 3 * period + 1.0, to_offline
            assert page.locator(f"{row} .badge").inner_text() == "offline"
            assert re.fullmatch(r"gone( \d+ s)?", page.locator(f"{row} td").last.inner_text()), (
                "heartbeat cell"
            )
            survivor = page.locator("#peers tbody tr[data-peer]:not([data-status=offline])")
            assert survivor.count() == 1 and survivor.get_attribute("data-peer") != victim_id
            assert not errors, errors
            shot = ARTIFACTS / "dashboard-peer-offline.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            browser.close()
        agree_with_dht(base, reader, run_id, 8)  # after the kill too

        dash.send_signal(signal.SIGTERM)
        assert dash.wait(timeout=30) == 0 and "dashboard stopped" in (tmp_path / "dash.log").read_text()
        peers[0].send_signal(signal.SIGTERM)
        # SIGTERM: the peer checkpoints and leaves, exiting 130 as after Ctrl+C (0 had it finished already)
        assert peers[0].wait(timeout=120) in (0, 130), (tmp_path / "p0.err").read_text()[-2000:]
        boot.send_signal(signal.SIGTERM)
        assert boot.wait(timeout=30) == 0, (tmp_path / "boot.log").read_text()[-2000:]
    finally:
        if reader is not None:
            reader.shutdown()
        reap(procs)
        remove_stale_p2p_sockets(sockets_before)  # the SIGKILLed peer's daemon could not remove its own
