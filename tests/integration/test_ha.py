"""vidx on a 3-node RabbitMQ cluster with quorum queues (infra/harness/ha.py: the nodes behind HAProxy, MinIO
publishing its bucket events through it): a stream of about a hundred uploads with overwrites and
deletes runs while the node leading the index queue is SIGKILLed with a task in the hands of a
consumer. Every queue vidx declared is a quorum queue; a new leader takes over, the killed node
rejoins, and once the stream drains every object is indexed exactly once at its current version,
every deleted one is gone, nothing was refused and ``vidx check`` finds nothing.

Prints ``ha: …`` with the invariants and the queues' types as ``rabbitmqctl list_queues name type``
shows them. The full node-loss run (MinIO and Ray nodes too, partitions, a flood) is bench/ha.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.harness.faults import (
    BUSY_TIMEOUT_S,
    AppHost,
    Fault,
    StreamPlan,
    converge,
    make_variants,
    run_stream,
    start_app,
    vidx_check,
)
from infra.harness.ha import RabbitCluster, start_ha_services
from infra.harness.services import queue_counts, unique_prefix
from tests.harness import report_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

#: Operations of the stream (uploads, overwrites, deletes: about 100 uploads) and their rate.
OPS = 155
RATE_PER_S = 3.0
CONVERGE_TIMEOUT_S = 240.0


#: Longest wait for the cluster to elect a new leader for the index queue.
ELECTION_TIMEOUT_S = 60.0
#: How long the fault tries again a management read that failed before the kill.
READ_RETRY_S = 30.0


@dataclass
class LeaderKill:
    leader: str
    new_leader: str
    #: The index queue's (ready, unacknowledged) tasks when the leader was killed.
    tasks: tuple[int, int]
    #: The nodes the index queue's consumers were connected to.
    consumer_nodes: list[str]
    elected_s: float
    rejoined_s: float

    def line(self) -> str:
        return (
            f"{self.leader} SIGKILLed (leader of the index queue, tasks {self.tasks[0]} ready + {self.tasks[1]} "
            f"unacked, consumers on {self.consumer_nodes}); new leader {self.new_leader or '-'} after "
            f"{self.elected_s:.1f}s, {self.leader} running again after {self.rejoined_s:.1f}s"
        )


def kill_index_queue_leader(host: AppHost, cluster: RabbitCluster, kills: list[LeaderKill]) -> str:
    """SIGKILL the node leading the index queue once a consumer holds a task unacknowledged (waits at
    most ``BUSY_TIMEOUT_S`` for one), then wait (bounded) until a new leader is elected and the node
    rejoined. Appends what happened to ``kills``."""
    queue = host.settings.serve.index_queue
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while queue_counts(host.services, queue)[1] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    tasks = queue_counts(host.services, queue)
    # Before the kill the cluster is whole: a read that fails is the loaded machine, and is tried again.
    consumer_nodes = cluster.consumer_nodes(queue, retry_s=READ_RETRY_S)
    leader = cluster.leader(queue, retry_s=READ_RETRY_S)
    cluster.kill_node(leader)
    started = time.monotonic()
    new_leader = ""
    while time.monotonic() - started < ELECTION_TIMEOUT_S:
        try:
            new_leader = cluster.leader(queue)
        except Exception:  # the management API answers from another node once the proxy notices
            new_leader = ""
        if new_leader and new_leader != leader:
            break
        time.sleep(0.2)
    elected_s = time.monotonic() - started
    kill = LeaderKill(leader, new_leader, tasks, consumer_nodes, elected_s, cluster.wait_running())
    kills.append(kill)
    return kill.line()


@pytest.fixture(scope="module")
def ha(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AppHost, RabbitCluster]]:
    with (
        start_ha_services() as ha,
        start_app(ha.services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state")) as host,
    ):
        yield host, ha.rabbit


def test_a_stream_through_a_quorum_queue_leader_kill_loses_and_duplicates_nothing(
    request: pytest.FixtureRequest, ha: tuple[AppHost, RabbitCluster], tmp_path: Path
) -> None:
    host, cluster = ha
    variants = make_variants(tmp_path, host.settings.sampling.every_s)
    plan = StreamPlan("ha-leader-kill", OPS, seed=20, rate_per_s=RATE_PER_S)
    kills: list[LeaderKill] = []
    fault = Fault(OPS // 3, "index queue leader SIGKILL", lambda: kill_index_queue_leader(host, cluster, kills))
    log = run_stream(host, plan, variants, [fault])
    summary, converge_s = converge(host, plan, log, CONVERGE_TIMEOUT_S)
    check = vidx_check(prefix=plan.prefix)
    prefix = host.settings.serve.index_queue.split(".", 1)[0]
    types = {name: kind for name, kind in cluster.queue_types().items() if name.startswith(f"{prefix}.")}
    report_lines(
        request.config,
        [
            f"ha: 3-node RabbitMQ cluster, quorum queues; uploads {log.uploads}, deletes {log.deletes}, "
            f"indexed {summary.indexed}, lost {summary.lost}, duplicated {summary.duplicated}, "
            f"refused {log.failed_ops}, vidx check {check.inconsistencies} inconsistencies + {check.in_flight} "
            f"queued/indexing; stream {log.stream_s:.1f}s, converged {converge_s:.1f}s later",
            *(f"  {note}" for note in log.notes),
            *(f"  error: {error}" for error in log.errors),
            f"  rabbitmqctl list_queues name type: {types}",
            *(f"  {item}" for item in check.found[:10]),
        ],
    )
    assert not log.errors, log.errors
    (kill,) = kills
    assert kill.tasks[1] > 0, "the leader was killed with no task in a consumer's hands"
    assert kill.new_leader and kill.new_leader != kill.leader, kill.line()
    assert log.uploads >= 90
    assert summary.lost == 0 and summary.duplicated == 0, summary.problems
    assert log.failed_ops == 0
    assert check.inconsistencies == 0 and check.in_flight == 0, check.found
    settings = host.settings
    ours = [settings.amqp.events_queue, settings.amqp.parked_queue, settings.serve.index_queue]
    assert {name: types.get(name) for name in ours} == dict.fromkeys(ours, "quorum"), types
    assert all(kind == "quorum" for kind in types.values()), types
