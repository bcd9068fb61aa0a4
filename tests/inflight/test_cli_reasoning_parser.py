"""``inflight gateway --reasoning-parser`` (vLLM's flag) reaches ``GatewaySettings``; an
unknown parser is refused by argparse, and by the settings when it comes from the
environment."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings
from inflight.cli import _gateway_settings, build_parser


def test_the_flag_sets_the_parser(monkeypatch):
    monkeypatch.delenv("INFLIGHT_GATEWAY_REASONING_PARSER", raising=False)
    args = build_parser().parse_args(["gateway", "--reasoning-parser", "deepseek_r1"])
    assert _gateway_settings(args, GatewaySettings, None, None).reasoning_parser == "deepseek_r1"
    args = build_parser().parse_args(["gateway"])
    assert _gateway_settings(args, GatewaySettings, None, None).reasoning_parser == ""


def test_unknown_parsers_are_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--reasoning-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        GatewaySettings.from_env({"INFLIGHT_GATEWAY_REASONING_PARSER": "granite"})
