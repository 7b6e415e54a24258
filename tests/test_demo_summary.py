"""``swarm-demo``'s summary: what each peer measured per round, and the design's prediction beside it."""

import json
from pathlib import Path

import pytest

from peers.demo_summary import print_summary, summarize
from swarm.config import ModelConfig
from swarm.model import MoETransformer
from swarm.sync.codecs import codec_named
from swarm.sync.round_traffic import ModelBytes, RoundTraffic
from swarm.train.checkpoint import save_checkpoint
from swarm.train.round_record import RoundRecord

MODEL = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_experts=8, expert_hidden=32,
                    top_k=2, max_seq_len=32)  # fmt: skip
EXPERTS = [[0, 1], [2, 3], [4, 5], [6, 7]]


def write_peer(run: Path, experts: list[int], wire: list[int]) -> None:
    """A peer's run directory: its final checkpoint and one round record per ``wire`` total (the last one
    the final round), as a peer writes them."""
    run.mkdir(parents=True)
    state = MoETransformer(MODEL, experts).canonical_state_dict()
    save_checkpoint(run / "checkpoints", 100, state, {}, {"local_experts": experts})
    rounds = [RoundRecord(step=10 * i, round=i, applied=True, dense_group=4, wire_total=w,
                          last=i == len(wire) - 1) for i, w in enumerate(wire)]  # fmt: skip
    lines = [{"step": 0, "val_loss": 6.0}, *(r.to_dict() for r in rounds), {"step": 100, "val_loss": 5.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("refresh_every, embeddings_every", [(1, 1), (4, 1), (4, 2)])
def test_the_prediction_is_the_mean_round_when_copies_move_every_kth(
    tmp_path, capsys, refresh_every, embeddings_every
):
    dirs = [tmp_path / f"peer{i}" for i in range(4)]
    for d, ex in zip(dirs, EXPERTS, strict=True):
        write_peer(d, ex, [1000, 4000, 5000, 9000, 10_000, 99_999])  # 4 rounds' bytes: 9000 in all
    int8, int4 = codec_named("int8"), codec_named("int4")
    s = summarize(dirs, 8, int8, int4, refresh_every=refresh_every, embeddings_every=embeddings_every)

    shapes = {k: t.shape for k, t in MoETransformer(MODEL, [0]).canonical_state_dict().items()}
    traffic = RoundTraffic.of(ModelBytes.of(shapes, int8, int4), EXPERTS, 8)
    assert traffic.copies > 0 and traffic.experts == 0  # one holder per expert: only copies and dense
    assert 0 < traffic.core < traffic.dense
    # with embeddings_every 2, every other round's dense all-reduce carries the core dense weights alone
    dense = (traffic.dense + (embeddings_every - 1) * traffic.core) / embeddings_every
    assert s["predicted_bytes_per_round"] == int(dense + traffic.copies / refresh_every)
    assert (s["refresh_every"], s["embeddings_every"]) == (refresh_every, embeddings_every)
    print_summary(s, 1.0)
    said = capsys.readouterr().out
    assert ("copies every 4 rounds" in said) == (refresh_every == 4), said
    assert ("all dense weights every 2 rounds" in said) == (embeddings_every == 2), said
    # measured: from the first ordinary round to the last (the final round's count left out), per round
    assert [p["bytes_per_round"] for p in s["peers"]] == [9000 // 4] * 4
    assert [p["rounds_clean"] for p in s["peers"]] == [6] * 4
    assert s["experts_covered"] == 8 and s["replicas"]["dense"] > 0  # different initialisations here
