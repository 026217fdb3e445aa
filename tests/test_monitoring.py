"""k8s/monitoring/ against the real thing: promtool checks and unit-tests the alert rules, and a real
Prometheus (Debian's package) scrapes a short local vitscale run, whose series then answer every
expression of the Grafana dashboard and the alert rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.prometheus_server import PrometheusServer, ensure_prometheus, metrics_ports

MONITORING = Path(__file__).resolve().parents[1] / "k8s" / "monitoring"
#: What Grafana puts in place of the dashboard's variables when every run and rank is picked.
GRAFANA_VARIABLES = {"$run": ".*", "$rank": ".*", "$__rate_interval": "1m"}


def rule_spec() -> dict[str, Any]:
    return yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]


def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def dashboard_exprs() -> dict[str, str]:
    """Panel title -> its PromQL, with Grafana's variables filled in."""
    out = {}
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            out[f"{panel['title']} ({target['refId']})"] = expr
    return out


def alert_exprs() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in rule_spec()["groups"] for r in g["rules"]}


def promtool_test(tmp_path: Path, spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    _, promtool = ensure_prometheus()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    shutil.copy(MONITORING / "alerts-test.yaml", tmp_path / "alerts-test.yaml")
    check = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    return subprocess.run([promtool, "test", "rules", "alerts-test.yaml"], cwd=tmp_path, capture_output=True, text=True)


def test_alert_rules_pass_promtool_and_their_unit_tests(tmp_path: Path) -> None:
    done = promtool_test(tmp_path, rule_spec())
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "alerts-test.yaml").read_text()))
    assert tested == set(alert_exprs()), "every alert has unit tests"
    text = (MONITORING / "alerts-test.yaml").read_text()
    assert all(re.search(rf"alertname: {a}\n\s+exp_alerts: \[\]", text) for a in alert_exprs()), \
        "every alert is tested staying silent as well as firing"


@pytest.mark.parametrize("alert", sorted(alert_exprs()))
def test_unit_tests_fail_when_an_alert_never_fires(alert: str, tmp_path: Path) -> None:
    spec = rule_spec()
    for group in spec["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = f"({rule['expr']}) and on() vector(0) > 1"  # never true
    done = promtool_test(tmp_path, spec)
    assert done.returncode != 0 and alert in done.stdout + done.stderr


def test_dashboard_has_each_panel_per_run_and_rank() -> None:
    exprs = " ".join(dashboard_exprs().values())
    for metric in ("vitscale_images_per_second", "vitscale_mfu_ratio", "vitscale_train_loss", "vitscale_learning_rate",
                   "vitscale_data_wait_seconds_sum", "vitscale_skipped_samples_total", "vitscale_checkpoint_seconds",
                   "vitscale_run_flops", "vitscale_last_checkpoint_timestamp_seconds"):
        assert metric in exprs, metric
    variables = {v["name"] for v in dashboard()["templating"]["list"]}
    assert {"run", "rank", "datasource"} <= variables
    assert all('run=~"$run"' in t["expr"] for p in dashboard()["panels"] for t in p["targets"])


# --------------------------------------------------------------------------- a real Prometheus, a real run


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory: pytest.TempPathFactory):
    """A 2-rank local vitscale run serving metrics on two ports, scraped every second by Prometheus."""
    ray = pytest.importorskip("ray")
    from vitscale.data.tools.write import write_dataset
    from vitscale.stages import build_pipeline
    from vitscale.stages.run import run_pipeline

    tmp = tmp_path_factory.mktemp("scraped")
    data = tmp / "data"
    write_dataset("synthetic", str(data), shard_size=40, max_side=32, seed=0,
                  source_options={"count": 80, "classes": 4, "image_size": 32}, progress=False)
    port = metrics_ports(2)  # both local ranks' ports: metrics_port + local rank
    (tmp / "prom").mkdir()
    server = PrometheusServer(tmp / "prom", [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    config = build_pipeline({
        "name": "scraped",
        "stages": ["pretrain"],
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2},
        "data": {"url": str(data), "num_workers": 0},
        # Enough steps to outlive several 1-second scrapes after the first checkpoint (a step takes milliseconds,
        # and Ray no longer holds the run at its poll); a stated peak makes MFU exist on CPU.
        "train": {"global_batch": 16, "micro_batch": 8, "max_steps": 480, "warmup_steps": 2, "zero_stage": 2,
                  "precision": "fp32", "checkpoint_every": 160, "log_every": 160, "metrics_port": port,
                  "peak_flops": 1e12},
        "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(tmp / "runs")},
    })
    ray.init(num_cpus=2, log_to_driver=False)
    try:
        run_pipeline(config)
        # The run is over and its endpoints gone: evaluate at the last moment Prometheus saw rank 0.
        last = server.query('max(last_over_time(timestamp(vitscale_step{rank="0"})[10m:1s]))')
        yield server, float(last["data"]["result"][0]["value"][1])
    finally:
        ray.shutdown()
        server.stop()


@pytest.mark.slow
def test_prometheus_sees_every_rank_of_the_run(scraped_run: tuple[PrometheusServer, float]) -> None:
    server, at = scraped_run
    for metric in ("vitscale_images_per_second", "vitscale_train_loss", "vitscale_mfu_ratio", "vitscale_step",
                   "vitscale_last_checkpoint_timestamp_seconds"):
        answer = server.query(f"last_over_time({metric}[10m])", at=at)
        assert answer["status"] == "success", answer
        labels = [r["metric"] for r in answer["data"]["result"]]
        assert {(m.get("run"), m.get("rank")) for m in labels} == {("scraped", "0"), ("scraped", "1")}, (metric, labels)


@pytest.mark.slow
def test_every_dashboard_and_alert_expression_evaluates(scraped_run: tuple[PrometheusServer, float]) -> None:
    server, at = scraped_run
    answers = {name: server.query(expr, at=at) for name, expr in {**dashboard_exprs(), **alert_exprs()}.items()}
    errors = {name: a.get("error") for name, a in answers.items() if a["status"] != "success"}
    assert errors == {}
    # The panels over gauges and counters have data for the run (rates need two scrapes in their window).
    empty = [n for n, a in answers.items() if n in dashboard_exprs() and not a["data"]["result"]]
    # The masked patch panel has data only for runs of that objective; this run is supervised.
    assert [n for n in empty if "Masked patch" not in n] == [], empty
