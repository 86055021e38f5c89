"""infra/prometheus/alerts.yml: the rules load in Prometheus's own checker and each fires on a series
that should fire it, and stays quiet on one that should not (infra/prometheus/alerts_test.yml), with
promtool built from the pinned Go module (waiting for the build ``make install`` started)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "infra" / "prometheus"
#: Longest wait for promtool: a build started by ``make install`` finishes, or one starts and finishes.
BUILD_TIMEOUT_S = 1500
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 120)

ALERTS = ("VidxServiceStalled", "VidxIndexBacklogGrowing", "VidxDeadLettersRising", "VidxCatalogWriterNotCommitting")


@pytest.fixture(scope="module")
def promtool() -> Path:
    built = subprocess.run(
        [str(ROOT / "infra" / "local" / "install-promtool.sh")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=True,
    )
    return Path(built.stdout.strip().splitlines()[-1])


def test_the_rules_load_in_promtool(promtool: Path) -> None:
    out = subprocess.run([str(promtool), "check", "rules", "alerts.yml"], cwd=RULES, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_each_alert_fires_when_it_should_and_not_otherwise(promtool: Path) -> None:
    tests = (RULES / "alerts_test.yml").read_text()
    assert all(f"alertname: {name}" in tests for name in ALERTS)  # every rule has its case
    out = subprocess.run([str(promtool), "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True, text=True)
    print(out.stdout.strip())
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_rule_that_no_longer_fires_fails_the_rule_tests(promtool: Path, tmp_path: Path) -> None:
    """The rule tests can fail: with the stall bound raised tenfold, the stalled service no longer fires."""
    rules = (RULES / "alerts.yml").read_text().replace("> 600\n", "> 6000\n")
    (tmp_path / "alerts.yml").write_text(rules)
    (tmp_path / "alerts_test.yml").write_text((RULES / "alerts_test.yml").read_text())
    out = subprocess.run(
        [str(promtool), "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode != 0 and "VidxServiceStalled" in out.stdout + out.stderr
