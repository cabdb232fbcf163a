"""Config: YAML + dotted overrides; unknown keys and bad values are named before any work starts."""

import re
from pathlib import Path

import pytest

from magclip.config import ConfigError, RunConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "clip"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_overrides_apply_with_yaml_types():
    cfg = load_config(CONFIGS / "default.yaml", ["train.epochs=2", "loss.t2i=null", "loss.i2t=qnorm",
                                                  "train.lr=3e-4", "name=x"])
    assert (cfg.train.epochs, cfg.loss.t2i, cfg.loss.i2t, cfg.train.lr, cfg.name) == (2, None, "qnorm", 3e-4, "x")


@pytest.mark.parametrize("override, message", [
    ("train.epoch=2", "unknown config key 'train.epoch'; allowed in train: epochs, max_steps"),
    ("trian.epochs=2", "unknown config key 'trian'"),
    ("train.epochs=two", "config key 'train.epochs' must be int, got 'two'"),
    ("loss.i2t=qnrom", "loss.i2t='qnrom' is not a scoring mode; allowed: cosine, dot, qnorm, dnorm, fixed, learnable"),
    ("train.precision=fp8", "train.precision='fp8'; allowed: fp32, bf16, fp16"),
    ("train.batch_size=0", "train.batch_size must be >= 1"),
    ("train.resume=/no/such/ckpt", "no such checkpoint"),
    ("train", "must look like key.sub=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(CONFIGS / "default.yaml", [override])


def test_both_directions_null_is_rejected():
    with pytest.raises(ConfigError, match="both null"):
        load_config(None, ["loss.i2t=null", "loss.t2i=null"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_the_builtin_defaults_are_the_main_job_recipe():
    """No config file is needed for the main job (a wheel install has none): configs/clip/default.yaml
    spells out exactly the built-in defaults."""
    assert load_config(CONFIGS / "default.yaml") == load_config(None)


@pytest.mark.parametrize("overrides, message", [
    (["loss.gamma_q=0.5"], "loss: gamma_q is set but no mode has free exponents"),
    (["loss.i2t=fixed", "loss.gamma_q=0.5"], "mode 'fixed' needs both gamma_q and gamma_d"),
    (["loss.i2t=learnable", "loss.gamma_d=1.5"], "gamma_d must lie in"),
])
def test_exponents_are_checked_with_the_modes_they_configure(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    # one pair of exponents for the free-exponent direction only: the cosine direction keeps its corner
    assert load_config(None, ["loss.i2t=learnable", "loss.gamma_q=0.25"]).loss.gamma_q == 0.25


def test_text_schema_shares_the_training_checks():
    from magclip.config import load_text_config

    with pytest.raises(ConfigError, match="train.batch_size must be >= 1"):
        load_text_config(None, ["data.beir=x", "train.batch_size=0"])
    with pytest.raises(ConfigError, match="loss.mode='cosin' is not a scoring mode"):
        load_text_config(None, ["data.beir=x", "loss.mode=cosin"])


@pytest.mark.parametrize("override, message", [
    ("train.lr=.nan", "config key 'train.lr' must be a finite number, got nan"),
    ("train.lr=.inf", "must be a finite number, got inf"),
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
    ("train.beta2=1.0", "train.beta2 must be in [0, 1)"),
    ("train.eps=0", "train.eps must be > 0"),
    ("train.lr=[1,", "override 'train.lr': value '[1,' is not valid YAML at line 1, column 4"),
    ("data.train=", "override 'data.train' has an empty value (an unset shell variable?); write data.train=null"),
])
def test_bad_numbers_yaml_and_empty_values_are_named_at_validation(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(CONFIGS / "emoji.yaml", [override])


def test_a_broken_yaml_file_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain: {epochs: 2, lr: ]\n")
    with pytest.raises(ConfigError, match=re.escape(f"{bad}: not valid YAML at line 2, column")):
        load_config(bad)
