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
            dht = hivemind.DHT(**kwargs)
        dht.wait_until_ready(timeout=wait_timeout)
    except Exception as e:  # hivemind raises several types; the user needs one clear line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DHTStartError(
            f"could not start the DHT node ({msg}); check --initial-peers and the address"
        ) from None
    return dht


@contextlib.contextmanager
def hivemind_child_signals():
    """Wrap the creation of hivemind's forked processes (DHT, averagers). Ctrl+C reaches the whole process
    group: those children must not die of it before the parent shuts them down cleanly (a killed daemon
    leaves sockets behind), so they inherit SIG_IGN for SIGINT; and they must not inherit the parent's
    Python SIGTERM handler (which turns SIGTERM into a checkpoint-and-leave), so SIGTERM is default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]
