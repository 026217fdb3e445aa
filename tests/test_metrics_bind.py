"""The Prometheus endpoint binds loopback unless told otherwise (`train.metrics_addr`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vitscale.config.checks import ConfigError
from vitscale.train.config import TrainConfig
from vitscale.train.metrics import MetricsSink


def test_default_binds_loopback_only(tmp_path: Path) -> None:
    assert TrainConfig().metrics_addr == "127.0.0.1"
    sink = MetricsSink(tmp_path, run="r", rank=0, port=0)
    try:
        assert sink.server.http.server_address[0] == "127.0.0.1"
    finally:
        sink.close()


def test_the_address_is_configurable_and_checked(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, run="r", rank=0, port=0, addr="0.0.0.0")
    try:
        assert sink.server.http.server_address[0] == "0.0.0.0"
    finally:
        sink.close()
    with pytest.raises(ConfigError, match="train.metrics_addr"):
        TrainConfig(metrics_addr="not an address!").validate()
