"""Time to train, energy, cost and the Young/Daly failure model against hand arithmetic."""

from __future__ import annotations

import json
import math

import pytest

from loom.config import ConfigError
from loom.planner.cost import parse_count, training_estimate
from loom.planner.reliability import (daly_interval, expected_wall_time, failure_overhead,
                                      job_mtbf, young_interval)


def test_young_and_daly_by_hand():
    # delta = 60 s, M = 3 h = 10800 s: Young sqrt(2 * 60 * 10800) = 1138.4 s
    assert young_interval(60, 10800) == pytest.approx(math.sqrt(1296000))
    x = 60 / (2 * 10800)
    daly = math.sqrt(1296000) * (1 + math.sqrt(x) / 3 + x / 9) - 60
    assert daly_interval(60, 10800) == pytest.approx(daly)
    assert daly == pytest.approx(1098.8, abs=0.05)
    assert daly_interval(100, 40) == 40  # delta >= 2M: checkpoint every M
    assert job_mtbf(6000 * 3600, 2000) == pytest.approx(3 * 3600)
    with pytest.raises(ValueError):
        job_mtbf(0, 10)


def test_expected_wall_time_by_hand():
    # T_s = 100 h of work, tau = 1 h, delta = 0.1 h, M = 10 h, R = 0.2 h (hours throughout)
    w = expected_wall_time(100, 1, 0.1, 10, 0.2)
    assert w == pytest.approx(10 * math.exp(0.02) * (math.exp(0.11) - 1) * 100)
    assert w == pytest.approx(118.63, abs=0.005)
    # no failures in the limit M -> infinity: work + checkpoints only
    assert expected_wall_time(100, 1, 0.1, 1e12) == pytest.approx(110, rel=1e-6)
    fo = failure_overhead(100, 0.1, 10, 0.2)
    assert fo["wall_s"] == pytest.approx(fo["checkpoint_s"] + fo["lost_s"] + 100)
    assert fo["checkpoint_s"] == pytest.approx(100 * 0.1 / fo["interval_s"])
    # Daly's interval minimizes the expected wall time (checked against neighbours)
    for f in (0.8, 1.25):
        assert expected_wall_time(100, f * fo["interval_s"], 0.1, 10, 0.2) > fo["wall_s"]


def test_parse_count():
    assert parse_count("300B") == 3e11
    assert parse_count("15T") == 1.5e13
    assert parse_count("2.5e9") == 2.5e9
    assert parse_count("10m") == 1e7
    for bad in ("", "abc", "-5B", "0", "3X"):
        with pytest.raises(ConfigError, match="--train-tokens"):
            parse_count(bad)


def test_training_estimate_by_hand():
    # 1e6 tokens/s on 1024 GPUs of 700 W, 300B tokens: 3e5 s = 3.472 days, 85,333 GPU-hours,
    # energy 85,333 h x 0.7 kW x 1.5 x 1.1 = 98,560 kWh, cost at $2 = $170,667
    est = training_estimate(1e6, 1024, 3e11, 1e9, tdp_w=700, node_overhead=1.5, pue=1.1,
                            gpu_hour_price=2.0)
    assert est["train_s"] == pytest.approx(3e5)
    assert est["days"] == pytest.approx(3e5 / 86400)
    assert est["gpu_hours"] == pytest.approx(1024 * 3e5 / 3600)
    assert est["energy_kwh"] == pytest.approx(1024 * 3e5 / 3600 * 0.7 * 1.5 * 1.1)
    assert est["cost"] == pytest.approx(2 * 1024 * 3e5 / 3600)
    assert "failures" not in est and est["wall_s"] == est["train_s"]


def test_training_estimate_with_failures_by_hand():
    # 1024 GPUs = 128 nodes of MTBF 12,800 h -> job MTBF 100 h; checkpoint 14 B x 1e11 params
    # at 1024 GB/s = 1.367 s; restart 600 s
    est = training_estimate(1e6, 1024, 3e11, 1e11, tdp_w=700, mtbf_hours_per_node=12800,
                            restart_s=600)
    fo = est["failures"]
    M, delta = 100 * 3600.0, 14 * 1e11 / 1024e9
    assert fo["job_mtbf_s"] == pytest.approx(M)
    assert fo["checkpoint_write_s"] == pytest.approx(delta)
    tau = daly_interval(delta, M)
    assert fo["interval_s"] == pytest.approx(tau)
    assert est["wall_s"] == pytest.approx(M * math.exp(600 / M) * math.expm1((tau + delta) / M)
                                          * 3e5 / tau)
    assert est["gpu_hours"] == pytest.approx(1024 * est["wall_s"] / 3600)
    assert est["wall_s"] > est["train_s"]


def test_cli_train_tokens_json(capsys):
    from loom.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt3-175b", "--num-gpus", "1024", "--global-batch-size", "1536",
              "--train-tokens", "300B", "--gpu-hour-price", "2", "--mtbf-hours-per-node",
              "6000", "--json", "--top", "3"])
    assert e.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    for r in doc["layouts"]:
        tr = r["training"]
        assert tr["days"] == pytest.approx(3e11 / r["tokens_per_s"] / 86400)
        assert tr["cost"] == pytest.approx(2 * tr["gpu_hours"])
        assert tr["wall_days"] > tr["days"] and tr["failures"]["interval_s"] > 0


def test_format_estimate_text():
    from loom.planner.cost import format_estimate
    est = training_estimate(1e6, 1024, 3e11, 1e9, tdp_w=700, node_overhead=1.5, pue=1.1,
                            gpu_hour_price=2.0)
    text = format_estimate(est)
    assert "300B tokens: 3.5 days" in text and "$170,667" in text and "98.56 MWh" in text
