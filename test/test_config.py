import argparse
import dataclasses

import pytest

from granikv.config import GraniKVConfig, add_cli_args, cli_flag, given_flags


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return GraniKVConfig.from_mapping(vars(parser.parse_args(argv)))


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = {opt for a in parser._actions for opt in a.option_strings}
    for f in dataclasses.fields(GraniKVConfig):
        assert cli_flag(f.name) in flags
    assert "--enable-granikv" in flags


def test_defaults_and_overrides():
    assert _parse([]) == GraniKVConfig()
    cfg = _parse(["--enable-granikv", "--granikv-hot-min-tokens", "37",
                  "--granikv-hot-fraction", "0.25", "--granikv-attention-path", "fused"])
    assert (cfg.enable, cfg.hot_min_tokens, cfg.hot_fraction, cfg.attention_path) == (
        True, 37, 0.25, "fused")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"hot_min_tokens": 3}, "--granikv-hot-min-tokens=3 is outside [16, "),
        ({"hot_min_sharers": 0}, "--granikv-hot-min-sharers=0"),
        ({"hot_fraction": 1.5}, "--granikv-hot-fraction=1.5 is outside [0.0, 1.0]"),
        ({"attention_path": "magic"}, "--granikv-attention-path='magic' is not one of auto"),
    ],
)
def test_invalid_values_name_flag_value_and_range(kwargs, needle):
    with pytest.raises(ValueError) as e:
        GraniKVConfig(**kwargs)
    assert needle in str(e.value)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GraniKVConfig().enable = True


def test_missing_cost_model_file_fails_at_startup(tmp_path):
    with pytest.raises(ValueError, match=r"--granikv-cost-model='.*nope.json': no such file"):
        GraniKVConfig(cost_model=str(tmp_path / "nope.json"))
    f = tmp_path / "cm.json"
    f.write_text("{}")
    assert GraniKVConfig(cost_model=str(f)).cost_model == str(f)


def test_unknown_option_key_is_an_error():
    with pytest.raises(ValueError, match="unknown GraniKV option.*granikv_hot_min_token;"):
        GraniKVConfig.from_mapping({"enable_granikv": True, "granikv_hot_min_token": 9})


def test_option_sets_are_checked_by_the_config_not_argparse():
    """argparse takes any value (a disabled GraniKV must not reject the command line); the
    config rejects it once GraniKV is enabled."""
    with pytest.raises(ValueError, match="--granikv-attention-path='magic' is not one of auto"):
        _parse(["--enable-granikv", "--granikv-attention-path", "magic"])
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert "{auto,cascade,fused,bgemm,paged}" in parser.format_help()


def test_given_flags_names_what_a_disabled_granikv_ignores():
    values = {"enable_granikv": None, "granikv_hot_fraction": 2.0, "granikv_log_interval": None,
              "model_path": "m"}
    assert given_flags(values) == ["--granikv-hot-fraction=2.0"]
    assert given_flags({"enable_granikv": True}) == []
