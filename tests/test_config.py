"""Typed config: presets load, overrides apply with types, bad values name their field."""

import pytest

from swarm.config import ConfigError, RunConfig, SyncConfig, config_from_dict, load_config, save_config


@pytest.mark.parametrize("name", ["demo", "spes-1b", "spes-7b"])
def test_presets_load(repo_root, name):
    cfg = load_config(repo_root / "configs" / f"{name}.yaml")
    assert isinstance(cfg, RunConfig)


def test_spes_presets_match_the_paper(repo_root):
    one = load_config(repo_root / "configs" / "spes-1b.yaml")
    m, t = one.model, one.train
    assert (m.d_model, m.n_layers, m.n_heads, m.n_experts, m.expert_hidden, m.top_k) == (
        768,
        12,
        12,
        16,
        2048,
        2,
    )
    assert (m.vocab_size, m.max_seq_len, m.rope_theta, m.tie_embeddings) == (151665, 2048, 5e5, False)
    assert (m.lb_loss_coef, m.z_loss_coef) == (0.01, 0.001)
    assert (one.experts.per_peer, one.sync.sync_every, one.data.seq_len) == (4, 100, 2048)
    assert (t.lr, t.warmup_steps, t.decay_steps, t.min_lr_ratio, t.betas) == (
        5e-4,
        2000,
        50000,
        0.1,
        (0.9, 0.95),
    )
    assert (t.weight_decay, t.grad_clip) == (0.1, 1.0)
    seven = load_config(repo_root / "configs" / "spes-7b.yaml")
    m = seven.model
    assert (m.d_model, m.n_layers, m.n_heads, m.n_experts, m.expert_hidden, m.top_k) == (
        2048,
        16,
        16,
        32,
        2048,
        4,
    )
    assert (seven.experts.per_peer, seven.train.lr) == (8, 4e-4)


def test_overrides_are_typed(repo_root):
    cfg = load_config(
        repo_root / "configs" / "demo.yaml",
        ["train.lr=3e-4", "experts.local=[1, 5]", "model.norm_topk_prob=true", "experts.per_peer=null"],
    )
    assert cfg.train.lr == 3e-4 and cfg.experts.local == [1, 5] and cfg.model.norm_topk_prob is True
    assert cfg.experts.resolve(cfg.model.n_experts) == [1, 5]


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"model": {"d_model": 100, "n_heads": 3}}, "model.d_model"),
        ({"model": {"top_k": 20}}, "model.top_k"),
        ({"model": {"moe_backend": "cuda_magic"}}, "model.moe_backend"),
        ({"train": {"betas": [0.9]}}, "train.betas"),
        ({"train": {"warmup_steps": 1.5}}, "train.warmup_steps"),
        ({"train": {"device": "tpu"}}, "train.device"),
        ({"train": {"expert_lr_scale": 0}}, "train.expert_lr_scale"),
        ({"experts": {"local": [1, 1]}}, "experts.local"),
        ({"experts": {"local": [0], "per_peer": 2}}, "experts.local"),
        ({"data": {"seq_len": 4096}}, "data.seq_len"),
        ({"sync": {"sync_alpha": 0}}, "sync.sync_alpha"),
        ({"sync": {"sync_every_s": 0.5}}, "sync.sync_every_s"),
        ({"sync": {"prematch_s": -1.0}}, "sync.prematch_s"),
        ({"sync": {"codec": "int3"}}, "sync.codec"),
        ({"sync": {"refresh_every": 0}}, "sync.refresh_every"),
        ({"sync": {"embeddings_every": 0}}, "sync.embeddings_every"),
        ({"mdoel": {}}, "mdoel"),
        ({"model": 3}, "model"),
    ],
)
def test_bad_values_name_their_field(raw, field):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value).startswith(field), str(info.value)
    assert "\n" not in str(info.value)


def test_save_and_reload_round_trip(tmp_path, repo_root):
    cfg = load_config(
        repo_root / "configs" / "spes-1b.yaml", ["experts.local=[3, 7]", "experts.per_peer=null"]
    )
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg and again.fingerprint() == cfg.fingerprint()


def test_fingerprint_covers_model_shape_only():
    base = config_from_dict({})
    assert config_from_dict({"train": {"lr": 1e-3}}).fingerprint() == base.fingerprint()
    assert config_from_dict({"model": {"n_layers": 5}}).fingerprint() != base.fingerprint()
    assert config_from_dict({"run_id": "other"}).fingerprint() != base.fingerprint()


def test_a_member_met_before_the_slot_is_waited_for_as_long_as_the_matchmaking_window():
    from swarm.config import SyncConfig
    from swarm.net.timing import Timing

    assert Timing.from_config(SyncConfig(sync_every_s=10, matchmaking_s=4.0, prematch_s=0)).late_s == 0.0
    assert Timing.from_config(SyncConfig(sync_every_s=10, matchmaking_s=4.0, prematch_s=2.0)).late_s == 4.0
    assert Timing.from_config(SyncConfig(matchmaking_s=4.0, prematch_s=2.0)).late_s == 0.0  # rounds by steps


def test_groups_meet_before_a_slot_by_prematch_s_at_most_a_quarter_of_it():
    from swarm.config import SyncConfig

    assert SyncConfig(sync_every_s=10).prematch_window_s == 2.0  # on by default
    assert SyncConfig(sync_every_s=4, prematch_s=2.0).prematch_window_s == 1.0
    assert SyncConfig(sync_every_s=10, prematch_s=0).prematch_window_s == 0.0
    assert SyncConfig(prematch_s=2.0).prematch_window_s == 0.0  # rounds by steps: no slot to meet before


def test_the_dense_weights_travel_in_int4_with_the_int8_default_and_as_the_codec_otherwise():
    assert SyncConfig().codec == "int8" and SyncConfig().dense_codec_name == "int4"
    assert SyncConfig(codec="fp32").dense_codec_name == "fp32"  # exact means everywhere, as asked
    assert SyncConfig(codec="int8", dense_codec="int8").dense_codec_name == "int8"
    assert SyncConfig(codec="fp16", dense_codec="int4").dense_codec_name == "int4"
    with pytest.raises(ConfigError, match="sync.dense_codec"):
        config_from_dict({"sync": {"dense_codec": "int3"}})
