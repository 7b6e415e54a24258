"""Starting a hivemind DHT node with safe defaults: loopback only, no NAT traversal, no relays.

    dht = start_dht(initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/Qm..."])
    print(visible_maddrs(dht))
    dht.shutdown()

hivemind's own defaults turn on UPnP port mapping, AutoNAT and relays, and its CLI listens on every
interface (see NOTES.md): a peer here exposes itself beyond loopback only when asked.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

import hivemind


class DHTStartError(RuntimeError):
    """The DHT node could not start or could not reach any initial peer. The message is one line."""


def start_dht(
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | Path | None = None,
    client_mode: bool = False,
    use_nat: bool = False,
    announce_host: str | None = None,
    wait_timeout: float = 30.0,
) -> hivemind.DHT:
    """Start a DHT node in a background process and return it once it is ready."""
    ip = "ip6" if ":" in host else "ip4"
    kwargs = dict(
        initial_peers=list(initial_peers),
        host_maddrs=[f"/{ip}/{host}/tcp/{port}"],
        client_mode=client_mode,
        nat_port_map=use_nat,
        auto_nat=use_nat,
        use_relay=use_nat,
        use_auto_relay=use_nat,
        use_ipfs=False,
        await_ready=False,
        start=True,
    )
    if announce_host:
        kwargs["announce_maddrs"] = [f"/{ip}/{announce_host}/tcp/{port}"]
    if identity_path is not None:
        kwargs["identity_path"] = str(identity_path)
    try:
        with hivemind_child_signals():
            dht = _DHT(**kwargs)
        dht.wait_until_ready(timeout=wait_timeout)
    except Exception as e:  # hivemind raises several types; the user needs one clear line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DHTStartError(
            f"could not start the DHT node ({msg}); check --initial-peers and the address"
        ) from None
    return dht


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def hivemind_child_signals():
    """Wrap the creation of hivemind's forked processes (DHT, averagers). Ctrl+C reaches the whole process
    group: those children must not die of it before the parent shuts them down cleanly (a killed daemon
    leaves sockets behind), and they must not run the parent's Python SIGTERM handler (which turns SIGTERM
    into a checkpoint-and-leave). So they fork with SIGINT and SIGTERM blocked and set their own
    (``as_hivemind_child``) before taking signals. In this process the signals are only held back until
    the fork is done: ignoring them here, as before, lost a Ctrl+C that landed while a group opened."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def as_hivemind_child() -> None:
    """First thing in a hivemind process forked under ``hivemind_child_signals``: Ctrl+C ignored (the
    parent shuts it down), SIGTERM kills it, then signals are taken again."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class _DHT(hivemind.DHT):
    def run(self) -> None:
        as_hivemind_child()
        super().run()


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]
