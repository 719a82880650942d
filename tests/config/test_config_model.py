"""One config model: each field has one rule, shared by the config, the rendezvous
options and the command line."""

from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stdout

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from slurm_elastic.cli.main import build_parser, main
from slurm_elastic.config import ElasticConfig, cli_flags, field_rule, load_config
from slurm_elastic.errors import ConfigError
from slurm_elastic.rendezvous.options import SHARED_WITH_CONFIG, RendezvousOptions


def test_heartbeat_miss_limit_1_is_rejected_by_the_config() -> None:
    # Before: the config accepted 1, the rendezvous required >= 2, and the agent failed
    # at start with exit code 6 (RENDEZVOUS_FAILED) on every node.
    with pytest.raises(ConfigError, match="'heartbeat_miss_limit' = 1: must be >= 2"):
        load_config(environ={}, overrides={"heartbeat_miss_limit": 1})
    assert load_config(environ={}, overrides={"heartbeat_miss_limit": 2}).heartbeat_miss_limit == 2


@pytest.mark.parametrize("name", SHARED_WITH_CONFIG)
def test_rendezvous_options_take_the_config_default(name: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(ElasticConfig)}
    assert getattr(RendezvousOptions(), name) == fields[name].default


def _options(**conf: str) -> RendezvousOptions:
    return RendezvousOptions.from_parameters(RendezvousParameters("slurm", "/x", "r", 1, 2, **conf))


@pytest.mark.parametrize(
    ("name", "low_ok", "too_low"),
    [
        ("join_timeout_s", 0.1, 0.09),
        ("last_call_timeout_s", 0.01, 0.0),
        ("close_timeout_s", 0.1, 0.05),
        ("heartbeat_interval_s", 0.05, 0.01),
        ("heartbeat_miss_limit", 2, 1),
    ],
)
def test_config_and_rendezvous_accept_and_reject_the_same_values(
    name: str, low_ok: float, too_low: float
) -> None:
    rule = field_rule(name)
    assert rule is not None
    key = name.removesuffix("_s")
    # accepted by both ...
    assert getattr(load_config(environ={}, overrides={name: low_ok}), name) == low_ok
    assert getattr(_options(**{key: str(low_ok)}), name) == low_ok
    # ... rejected by both, with the same rule
    with pytest.raises(ConfigError, match=f"'{name}' = .*: {rule.text}"):
        load_config(environ={}, overrides={name: too_low})
    with pytest.raises(ConfigError, match=f"rendezvous option {key}=.* {rule.text}"):
        _options(**{key: str(too_low)})


def test_every_config_flag_comes_from_field_metadata() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    for command in ("agent", "config"):
        dests = {a.dest: a for a in sub[command]._actions}
        for name, flag in cli_flags().items():
            assert name in dests, f"{command}: no flag for config key {name}"
            assert tuple(dests[name].option_strings) == flag.names
    # fields without a flag in their metadata get none (set them in YAML or env)
    assert "heartbeat_miss_limit" not in cli_flags()


def test_flags_parse_to_the_field_type_and_reach_the_config() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(
            [
                "config",
                "--nnodes",
                "2:3",
                "--hang-timeout",
                "7.5",
                "--max-requeues",
                "4",
                "--rdzv-id",
                "r9",
                "--requeue",
                "never",
                "--signal",
                "sigusr1",
            ]
        )
    assert code == 0
    cfg = json.loads(out.getvalue())
    assert (cfg["min_nodes"], cfg["max_nodes"], cfg["hang_timeout_s"]) == (2, 3, 7.5)
    assert (cfg["max_requeues"], cfg["run_id"], cfg["requeue"]) == (4, "r9", "never")
    assert cfg["preempt_signal"] == "USR1"


def test_a_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(SystemExit):
        main(["config", "--requeue", "sometimes"])
