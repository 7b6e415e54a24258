"""Starting a hivemind DHT node with safe defaults: loopback only, no NAT traversal, no relays.

    dht = start_dht(initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/Qm..."])
    print(visible_maddrs(dht))
    dht.shutdown()

hivemind's own defaults turn on UPnP port mapping, AutoNAT and relays, and its CLI listens on every
interface (see NOTES.md): a peer here exposes itself beyond loopback only when asked.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import hivemind
from hivemind.dht.routing import DHTID

from swarm.net.dht_auth import SwarmKeyAuthorizer
from swarm.net.identity import IdentityError, PeerIdentity
from swarm.net.p2p_sockets import YOUNG_S, not_listened, p2p_sockets, remove_stale_p2p_sockets
from swarm.net.swarm_key import SwarmKey


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
    swarm_key: SwarmKey | None = None,
) -> hivemind.DHT:
    """Start a DHT node in a background process and return it once it is ready. Its peer id is an RSA key
    (``identity_path``: kept there, created if absent; else a new one), which also signs its records
    (``dht.identity``; ``swarm.net.identity``). With ``swarm_key``, it talks only to nodes that hold the
    key (``swarm.net.dht_auth``); ``dht.swarm_key`` is kept for the groups and readers that check members."""
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
    with contextlib.ExitStack() as stack:
        if identity_path is not None:
            fresh = not Path(identity_path).exists()
            try:
                identity = PeerIdentity.load_or_create(identity_path)
            except IdentityError as e:
                raise DHTStartError(str(e)) from None
        else:  # p2pd reads its key from a file: a private one, gone once the node has started
            fresh, identity = True, PeerIdentity.create()
            identity_path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "peer.id"
            identity.write(identity_path)
        # a key made just now cannot be in use: skip hivemind's check, which asks the initial peers
        kwargs |= dict(identity_path=str(identity_path), check_if_identity_free=not fresh)
        # the node's place in the DHT follows from its identity, as its peer id does: hivemind draws a new
        # random one per start, and a peer restarted with its identity then sat in others' routing tables
        # twice (old and new node id, one peer id), so a store reached it twice, the second copy was refused
        # as not newer, and the whole store read as failed ("could not publish digest" every round)
        kwargs["node_id"] = DHTID.generate(source=f"swarm-dht-node:{identity.peer_id}".encode())
        kwargs["record_validators"] = [identity.validator()]
        if swarm_key is not None:
            kwargs["authorizer"] = SwarmKeyAuthorizer(swarm_key)
        dht = _started(kwargs, wait_timeout)
    if dht.peer_id.to_base58() != identity.peer_id:  # records would be signed by a key that is not ours
        dht.shutdown()
        raise DHTStartError(f"the DHT node's peer id is not its identity's ({identity_path})")
    dht.identity, dht.swarm_key = identity, swarm_key
    return dht


def _started(kwargs: dict, wait_timeout: float) -> hivemind.DHT:
    before, dht = p2p_sockets(), None
    try:
        with hivemind_child_signals():
            dht = _DHT(**kwargs)
        dht.wait_until_ready(timeout=wait_timeout)
        dht.daemon_socket = _daemon_socket(dht)
    except Exception as e:  # hivemind raises several types; the user needs one clear line
        _clean_up_failed_start(dht, before)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "the address, and that this node has the swarm key (--swarm-key)"
        raise DHTStartError(f"could not start the DHT node ({msg}); check --initial-peers, {hint}") from None
    return dht


def _clean_up_failed_start(dht: hivemind.DHT | None, before: set) -> None:
    """A node that failed to bootstrap ends its process, and its p2p daemon dies without removing its socket
    (in about half of the starts refused for a wrong swarm key): stop what is left and remove that socket
    once it is old enough to be told from one that another process is still setting up."""
    if dht is not None and dht.is_alive():
        dht.shutdown()
    # no new socket (the node failed before its daemon started): nothing to wait for
    if p2p_sockets() - before:
        time.sleep(YOUNG_S + 0.1)
        remove_stale_p2p_sockets(before)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"  # read by the p2p daemon (go-libp2p's TCP transport)
DAEMON_STOP_S = 2.0  # how long a node's shutdown waits for its p2p daemon to stop listening


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
    parent shuts it down), SIGTERM kills it, then signals are taken again. Its torch runs on one thread:
    OpenMP's pool does not survive a fork, and a parallel region in a child forked after the parent used it
    can hang forever (seen: a served copy compressed in an averager, a download decoded in the DHT)."""
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class DHTRequests:
    """The DHT process's end of its request pipe (hivemind's ``_inner_pipe``), where one request that cannot
    be read is dropped instead of ending the process.

    A request carries an MPFuture whose pipe travels through its sender's resource sharer. When the sender
    (an averager closing) exits while the DHT fetches that pipe, reading the request fails: mostly with
    ConnectionResetError, which hivemind's loop logs and skips, but on a clean close with EOFError
    (``multiprocessing.reduction.recvfds``), which it does not catch: the DHT process ends, and every later
    call to it waits forever (the likely cause of a hang seen in the suite). Any failure to read one request
    is an OSError here; the pipe itself closing (EOFError from reading its bytes: the parent is gone) still
    ends the loop."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn

    def recv(self) -> object:
        buf = self._conn.recv_bytes()
        try:
            return ForkingPickler.loads(buf)
        except Exception as e:
            raise OSError(f"dropped a request that could not be read ({type(e).__name__}: {e})") from e

    def __getattr__(self, name: str) -> object:  # poll, fileno, close: the connection's own
        return getattr(self._conn, name)


async def _daemon_path(_dht: hivemind.DHT, node) -> str:  # runs in the DHT's process
    return str(node.p2p._daemon_listen_maddr).removeprefix("/unix")


def _daemon_socket(dht: hivemind.DHT) -> Path | None:
    """The unix socket of the node's p2p daemon, or None if the node cannot say."""
    try:
        path = Path(dht.run_coroutine(_daemon_path))
    except Exception:
        return None
    return path if path.name.startswith("hivemind-p2pd-") else None


class _DHT(hivemind.DHT):
    daemon_socket: Path | None = None

    def __init__(self, *args, **kwargs) -> None:
        # read in the child (``run``), before it starts its p2p daemon; ``start_dht`` passes ``use_nat`` as
        # hivemind's ``use_relay`` (among others), the one of them this class sees
        self.reuse_port = bool(kwargs.get("use_relay"))
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        as_hivemind_child()
        if not self.reuse_port:
            # go-libp2p dials from its listening port (SO_REUSEPORT) unless told not to. Two peers that dial
            # each other at once over a link with any latency (new peers do, as their DHTs fill) then get
            # one TCP connection on which both are the initiator: its security handshake fails ("noise:
            # message is too short") and each backs off from dialing the other for seconds. On 20-100 ms
            # links four new peers' first all-reduce took 10-20 s instead of 2 (benchmarks/first_contact.py).
            # Only NAT traversal (hole punching, with ``use_nat``) needs the listening port as the source.
            os.environ.setdefault(REUSEPORT_ENV, "false")
        self._inner_pipe = DHTRequests(self._inner_pipe)
        super().run()

    def shutdown(self) -> None:
        """hivemind's, then its p2p daemon's socket if the daemon died without removing it: on 2 cores a
        peer refused for another model's fingerprint, which stops its node a second after starting it,
        left it in 2 of 7 runs of ``test_swarm``'s first test."""
        super().shutdown()
        path, deadline = self.daemon_socket, time.monotonic() + DAEMON_STOP_S
        while path is not None and path.exists() and time.monotonic() < deadline:
            if not_listened(path):
                path.unlink(missing_ok=True)
                return
            time.sleep(0.05)  # the daemon is still stopping: it may yet remove its socket itself


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]
