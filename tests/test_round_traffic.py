"""``round_traffic``: a round's bytes per peer from the config, and whether the presets fit 100 Mbit/s."""

import dataclasses
from pathlib import Path

import pytest

from swarm.config import load_config
from swarm.model import MoETransformer
from swarm.sync.codecs import codec_named
from swarm.sync.round_traffic import ModelBytes, RoundTraffic, round_traffic, slow_link_advice

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_count_follows_the_design_per_part_and_per_holder():
    sizes = ModelBytes(dense=100, expert=10, copy=5)
    # two holders per expert: each holder's all-reduce moves 4(2-1)/2 of an expert's bytes, for 2 experts
    two = RoundTraffic.of(sizes, [[0, 1], [2, 3], [0, 1], [2, 3]], 4)
    assert (two.dense, two.experts, two.copies, two.per_peer) == (300, 40, 20, 360)
    # copies moved every 4th round (sync.refresh_every): a quarter of them per round, on the mean
    assert (two.mean_per_peer(), two.mean_per_peer(4)) == (360, 345)
    # the core dense weights alone between full dense rounds (sync.embeddings_every)
    core = RoundTraffic.of(ModelBytes(dense=100, expert=10, copy=5, core=20), [[0, 1], [2, 3]] * 2, 4)
    assert (core.dense, core.core, core.mean_per_peer(4), core.mean_per_peer(4, 4)) == (300, 60, 345, 165)
    one = RoundTraffic.of(sizes, [[0], [1], [2], [3]], 4)  # sole holders: copies of the three others
    assert (one.experts, one.copies) == (0, 2 * 3 * 5)
    assert one.link_seconds(100) == one.per_peer / 2 / 12.5e6


def test_the_demo_config_predicts_what_its_model_tensors_add_up_to():
    """The shapes come from the model built on the meta device; a real one gives the same. 7.27 MB is the
    prediction every ``swarm-demo`` summary prints (it measured 7.6 MB at the peers' p2pd)."""
    cfg = load_config(CONFIGS / "demo.yaml")
    traffic = round_traffic(cfg)
    model = MoETransformer(cfg.model, [0, 1, 2, 3])
    shapes = {name: t.shape for name, t in model.canonical_state_dict().items()}
    sizes = ModelBytes.of(shapes, codec_named("int8"), codec_named("int4"))
    experts = [[4 * i + j for j in range(4)] for i in range(4)]
    assert traffic == RoundTraffic.of(sizes, experts, 16)
    assert traffic.peers == 4 and round(traffic.per_peer / 1e6, 2) == 7.27
    fp32 = round_traffic(dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, codec="fp32")))
    one_expert = sum(
        t.numel() // t.shape[0] for name, t in model.canonical_state_dict().items() if ".experts." in name
    )
    assert fp32.copies == 2 * 12 * 2 * one_expert  # 12 copies in and 12 out, in fp16
    assert 7 < fp32.dense / traffic.dense < 8  # fp32 against int4 and its block scales
    # all dense weights but the embeddings and output head: a fifth of the dense bytes in the demo
    core = [t.numel() for name, t in shapes.items() if ".experts." not in name and "embed" not in name
            and "lm_head" not in name]  # fmt: skip
    assert sizes.core == sum(codec_named("int4").wire_bytes(n) for n in core)
    assert 0.2 < sizes.core / sizes.dense < 0.22 and traffic.core == int(4 * 3 / 4 * sizes.core)


@pytest.mark.parametrize("name", ["demo", "demo-gpu", "spes-1b", "spes-7b"])
def test_every_preset_fits_a_100_mbit_link_and_a_short_timeout_is_named(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert slow_link_advice(cfg) is None
    short = dataclasses.replace(
        cfg, sync=dataclasses.replace(cfg.sync, round_timeout_s=10.0, matchmaking_s=5.0)
    )
    advice = slow_link_advice(short, mbit=1.0)  # 1 Mbit/s: no preset's round fits in 10 s
    assert advice is not None and "sync.round_timeout_s=10" in advice, advice
