"""``swarm-peer``: one training participant.

    swarm-peer --config configs/demo.yaml --solo --run-dir runs/demo [--max-steps N] [--resume]
    swarm-peer --config configs/demo.yaml --initial-peers MADDR ... --run-dir runs/peer1

With ``--initial-peers`` the peer joins the swarm: it refuses a run whose model differs, claims the experts
with the fewest live holders, fetches the current weights if the swarm has already trained, and
synchronises every ``sync.sync_every`` steps. Bad input (config, data, tokenizer, checkpoint, another
model in the swarm) prints one ``error:`` line and exits with code 2.

Several devices in one peer (data parallel, see ``swarm.train.local_ranks``)::

    torchrun --standalone --nproc-per-node 4 -m peers.main --config ... --initial-peers MADDR ...

Only rank 0 joins the swarm and writes the run dir; the other ranks train on rank 0's weights.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from swarm.config import ConfigError, RunConfig, load_config
from swarm.data import DataError
from swarm.hf.init_from import apply_init_weights, load_init_weights
from swarm.model import BackendUnavailable
from swarm.net.swarm_key import SwarmKeyError, add_swarm_key_args, swarm_key_args, swarm_key_from_args
from swarm.train import CheckpointError, NoSync, Trainer
from swarm.train.cpu_allocator import keep_freed_memory
from swarm.train.import_ahead import ImportAhead
from swarm.train.local_ranks import LocalRanks, collective_timeout_s
from swarm.train.process_exit import exit_process
from swarm.train.trainer import pick_device

EXIT_BAD_INPUT = 2
DYNAMO_IMPORT_WAIT_S = 120.0  # its seconds of CPU on a loaded machine, many times over


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-peer", description="Train one peer of a swarm MoE run.")
    ap.add_argument("--config", required=True, help="YAML preset, e.g. configs/demo.yaml")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=3e-4 (repeatable)",
    )
    ap.add_argument("--solo", action="store_true", help="train alone, with no swarm")
    ap.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="MADDR", help="join the swarm through these"
    )
    ap.add_argument("--host", default="127.0.0.1", help="address this peer listens on (default: loopback)")
    ap.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    ap.add_argument(
        "--identity", default=None, metavar="FILE",
        help="private key file: the peer id, kept across restarts (default: RUN_DIR/peer.id)",
    )  # fmt: skip
    add_swarm_key_args(ap)
    ap.add_argument("--use-nat", action="store_true", help="enable UPnP, AutoNAT and relays (off by default)")
    ap.add_argument(
        "--run-dir", default="runs/peer", help="metrics.jsonl, config.yaml and checkpoints/ go here"
    )
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run-dir")
    ap.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start a fresh run from these weights: a HF model dir (swarm-export) or a swarm checkpoint "
        "(swarm-upcycle); its model must match the config",
    )
    ap.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps in total"
    )
    ap.add_argument("--max-minutes", type=float, default=None, help="stop after this much wall time")
    ap.add_argument(
        "--stop-at",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="stop at this wall time; peers given the same value take their last round together",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


_interrupted = False
_stop_requested = threading.Event()


def _terminate(signum, frame):  # SIGINT and SIGTERM: checkpoint, then leave
    _stop_requested.set()  # for when the exception lands where Python ignores it (see Trainer)
    raise KeyboardInterrupt


def _terminate_once(signum, frame):
    """Under torchrun a Ctrl+C reaches a rank twice (from the terminal, then forwarded by torchrun): only
    the first counts, so that rank 0's checkpoint is not cut short."""
    global _interrupted
    _interrupted = True
    _stop_requested.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _own_process_group() -> None:
    os.setpgid(0, 0)


def _join_swarm(cfg: RunConfig, args: argparse.Namespace, trainer: Trainer, init_state=None):
    """Start the DHT node, check the run, claim experts, set up the trainer and catch up. Returns the DHT."""
    from swarm.net.catch_up import catch_up
    from swarm.net.dht_node import start_dht, visible_maddrs
    from swarm.net.hivemind_transport import HivemindStore, HivemindTransport, copy_bound
    from swarm.net.joining import claim_experts, open_swarm_sync
    from swarm.net.records import check_or_publish_fingerprint
    from swarm.net.timing import Timing
    from swarm.sync.round_traffic import slow_link_advice

    # the same peer id after a restart (its records, its place in groups): the run dir keeps it by default
    identity = args.identity
    if identity is None:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        identity = Path(args.run_dir) / "peer.id"
    dht = start_dht(
        args.initial_peers,
        host=args.host,
        port=args.port,
        identity_path=identity,
        use_nat=args.use_nat,
        swarm_key=swarm_key_from_args(args),
    )
    me, store = dht.peer_id.to_base58(), HivemindStore(dht)
    # any peer is an entry point: its addresses join the swarm as well as a bootstrap's (its peer id is what
    # a closed swarm's allowlist names)
    maddrs = visible_maddrs(dht)
    join = ["swarm-peer", "--config", args.config, "--initial-peers", *maddrs, *swarm_key_args(args)]
    join += [a for item in args.set for a in ("--set", item)]  # overrides change the model's fingerprint
    print(f"peer id: {me}; others may join through it: {shlex.join(join)}", file=sys.stderr, flush=True)
    check_or_publish_fingerprint(store, cfg.run_id, me, cfg.fingerprint())
    if cfg.data.seed is None:  # each peer samples its own windows
        cfg.data.seed = int.from_bytes(hashlib.sha256(me.encode()).digest()[:4], "little")
    # The optimizer's first add_param_group imports torch._dynamo, seconds of CPU: done while the claim
    # waits for simultaneous joiners instead of after it. Only after the DHT has forked its process (a child
    # forked mid-import would inherit the module's lock held); set-up (torch.compile) waits for it to end.
    ahead = ImportAhead("torch._dynamo")
    local, peers = claim_experts(store, me, cfg)
    if not ahead.wait(timeout=DYNAMO_IMPORT_WAIT_S):
        print(f"warning: importing torch._dynamo took over {DYNAMO_IMPORT_WAIT_S:g} s", file=sys.stderr)
    trainer.setup(resume=args.resume, local_experts=local)
    apply_init_weights(trainer, init_state, args.init_from)  # before catching up: the swarm's weights win
    caught_up = None
    if any(hb.step > 0 for hb in peers.values()):  # the swarm has trained: take its weights
        bound = copy_bound(trainer.model)
        transport = HivemindTransport(dht, Timing.from_config(cfg.sync), max_copy_bytes=bound)
        # a peer resumed from a checkpoint holds its experts as of its step: only newer copies replace them
        held = {e: trainer.step for e in trainer.model.local_experts} if trainer.step > 0 else {}
        caught_up = catch_up(
            transport, cfg.run_id, trainer.model, peers, cfg.sync.download_timeout_s, held, cfg.train.lr
        )
        trainer.evaluate_at_start = trainer.step > 0
    print(
        f"peer {me[-12:]} joined run {cfg.run_id!r}: experts {trainer.model.local_experts}, "
        f"{len(peers)} other live peer(s)",
        file=sys.stderr,
        flush=True,
    )
    advice = slow_link_advice(cfg)
    if advice:  # a preset or override sized for fast links: say so before rounds time out one by one
        print(f"warning: {advice}", file=sys.stderr, flush=True)
    last_round_at = None if args.stop_at is None else args.stop_at + 2 * cfg.sync.matchmaking_s + 5
    trainer.sync = open_swarm_sync(cfg, dht, trainer.model, last_round_at, caught_up)
    return dht


def main(argv: list[str] | None = None) -> int:
    _stack_dumps()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # a local rank's signal can land while it handles a lost rank 0: still 130
        return 130


def _stack_dumps() -> None:
    """A crash (SIGSEGV, SIGABRT, ...) prints every thread's stack to stderr, and so does `kill -USR1 PID`:
    where a peer that seems stuck is waiting. Not where stderr is no file (main() called in process)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    trainer = dht = ranks = None
    try:
        cfg = load_config(args.config, args.set)
        if args.solo == bool(args.initial_peers):
            raise ConfigError("give either --solo or --initial-peers MADDR ...")
        if args.max_steps is not None and args.max_steps < 0:
            raise ConfigError("--max-steps: must be >= 0")
        # SIGINT too: started from a background job, a process inherits SIGINT ignored and Python leaves it
        # so, yet `kill -INT` must still checkpoint and stop a peer
        signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGINT, _terminate)
        ranks = LocalRanks.from_env()  # a torchrun launch: one peer over several local devices
        if ranks is not None:
            signal.signal(signal.SIGTERM, _terminate_once)
            signal.signal(signal.SIGINT, _terminate_once)
            ranks.init(pick_device(cfg.train.device), timeout_s=collective_timeout_s(cfg))
            if ranks.is_leader and not args.solo:
                # torchrun signals each rank's whole process group: hivemind's processes (DHT, averagers,
                # p2pd) get groups of their own, so that rank 0 leaves the swarm in order, as a plain peer
                os.register_at_fork(after_in_child=_own_process_group)
        if pick_device(cfg.train.device).type == "cpu":
            keep_freed_memory()
        leader = ranks is None or ranks.is_leader
        if leader and not args.solo:
            swarm_key_from_args(args)  # a bad key file fails now, before the model is built
        trainer = Trainer(
            cfg,
            Path(args.run_dir),
            sync=NoSync(),
            progress=not args.no_progress and leader,
            ranks=ranks,
            stop=_stop_requested,
        )
        if leader:  # ranks > 0 never touch the swarm or the run dir
            # read and check --init-from before set-up writes anything to the run dir
            init_state = (
                load_init_weights(args.init_from, cfg, args.run_dir, args.resume) if args.init_from else None
            )
            if args.solo:
                trainer.setup(resume=args.resume)
                apply_init_weights(trainer, init_state, args.init_from)
            else:
                dht = _join_swarm(cfg, args, trainer, init_state)
        if ranks is not None:
            ranks.share_setup(trainer)  # every rank starts from rank 0's experts and weights
        limits = [60 * args.max_minutes] if args.max_minutes is not None else []
        if args.stop_at is not None:
            limits.append(args.stop_at - time.time())
        summary = trainer.train(args.max_steps, min(limits) if limits else None)
        if not leader:
            return 0
        if "initial_val_loss" in summary:
            a, b = summary["initial_val_loss"], summary["final_val_loss"]
            print(
                f"validation loss {a:.3f} -> {b:.3f} ({(b - a) / a:+.0%}) after {summary['end_step']} steps, "
                f"{summary['tokens']:,} tokens; run dir {args.run_dir}",
                file=sys.stderr,
            )
        print(json.dumps({"run_dir": str(args.run_dir), **summary}), flush=True)
        return 0
    except (ConfigError, DataError, CheckpointError, BackendUnavailable, SwarmKeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        if ranks is not None and not ranks.is_leader:  # never imports hivemind
            # a collective failed because rank 0 left (it said why), e.g. gloo's "Connection closed by peer";
            # rank 0 runs the same code, so any other error shows there with its traceback too
            if isinstance(e, RuntimeError):
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                print(f"local rank {ranks.rank} stopped: rank 0 left ({why})", file=sys.stderr)
                return 130 if _interrupted else 1
            raise
        from swarm.net.dht_node import DHTStartError
        from swarm.net.records import FingerprintMismatch

        if isinstance(e, (FingerprintMismatch, DHTStartError)):
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    except KeyboardInterrupt:
        return 130
    finally:
        if ranks is not None:  # first: ranks still waiting on this one fail at once
            ranks.close()
        if trainer is not None:
            trainer.close()
        if dht is not None:
            dht.shutdown()


def command() -> None:
    """The ``swarm-peer`` console script: ``main()``, then an exit that a round abandoned mid-way cannot
    turn into an abort (see ``swarm.train.process_exit``)."""
    raise SystemExit(exit_process(main()))


if __name__ == "__main__":
    command()
