"""events/subscribe.py: the bucket subscription keeps other rules, is idempotent, and waits (bounded) for
a MinIO that does not know its target yet."""

from __future__ import annotations

import pytest
from minio.error import S3Error
from minio.notificationconfig import NotificationConfig, PrefixFilterRule, QueueConfig

from events.config import AmqpSettings
from events.subscribe import CONFIG_ID, SUBSCRIBED_EVENTS, minio_notify_env, subscribe_bucket

ARN = AmqpSettings().queue_arn


class FakeMinio:
    """Stand-in for the two minio.Minio calls subscribe_bucket makes."""

    def __init__(self, config: NotificationConfig) -> None:
        self.config = config
        self.sets = 0

    def get_bucket_notification(self, bucket: str) -> NotificationConfig:
        return self.config

    def set_bucket_notification(self, bucket: str, config: NotificationConfig) -> None:
        self.config = config
        self.sets += 1


def test_subscribing_keeps_other_rules_and_is_idempotent() -> None:
    other = QueueConfig(
        queue="arn:minio:sqs::OTHER:webhook",
        events=["s3:ObjectCreated:*"],
        config_id="someone-else",
        prefix_filter_rule=PrefixFilterRule("images/"),
    )
    client = FakeMinio(NotificationConfig(queue_config_list=[other]))
    assert subscribe_bucket(client, "videos", ARN) is True  # type: ignore[arg-type]
    assert subscribe_bucket(client, "videos", ARN) is False  # type: ignore[arg-type]
    assert client.sets == 1
    rules = {q.config_id: q for q in client.config.queue_config_list}
    assert rules["someone-else"] is other
    assert rules[CONFIG_ID].queue == ARN and sorted(rules[CONFIG_ID].events) == sorted(SUBSCRIBED_EVENTS)


def test_a_changed_target_replaces_only_our_rule() -> None:
    stale = QueueConfig(queue="arn:minio:sqs::OLD:amqp", events=["s3:ObjectCreated:*"], config_id=CONFIG_ID)
    client = FakeMinio(NotificationConfig(queue_config_list=[stale]))
    assert subscribe_bucket(client, "videos", ARN) is True  # type: ignore[arg-type]
    assert [q.queue for q in client.config.queue_config_list] == [ARN]


def test_minio_target_is_durable_with_literal_on_flags() -> None:
    env = minio_notify_env(AmqpSettings(), "amqp://u:p@rabbit:5672", "/queue")
    target = AmqpSettings().minio_target_id
    for flag in ("ENABLE", "DURABLE", "PUBLISHING_CONFIRMS"):
        assert env[f"MINIO_NOTIFY_AMQP_{flag}_{target}"] == "on"  # MinIO reads "true" as off
    assert env[f"MINIO_NOTIFY_AMQP_DELIVERY_MODE_{target}"] == "2"
    assert env[f"MINIO_NOTIFY_AMQP_QUEUE_DIR_{target}"] == "/queue"
    assert env[f"MINIO_NOTIFY_AMQP_EXCHANGE_{target}"] == AmqpSettings().exchange


def test_dual_delivery_adds_a_fast_target_without_a_store_beside_the_durable_one() -> None:
    amqp = AmqpSettings(event_delivery="dual")
    env = minio_notify_env(amqp, "amqp://u:p@rabbit:5672", "/queue")
    durable, fast = amqp.minio_target_id, amqp.minio_fast_target_id
    assert env[f"MINIO_NOTIFY_AMQP_QUEUE_DIR_{durable}"] == "/queue"
    assert env[f"MINIO_NOTIFY_AMQP_ENABLE_{fast}"] == "on"
    assert env[f"MINIO_NOTIFY_AMQP_EXCHANGE_{fast}"] == env[f"MINIO_NOTIFY_AMQP_EXCHANGE_{durable}"]
    assert env[f"MINIO_NOTIFY_AMQP_ROUTING_KEY_{fast}"] == env[f"MINIO_NOTIFY_AMQP_ROUTING_KEY_{durable}"]
    assert not any(k.endswith(f"_{fast}") and ("QUEUE_DIR" in k or "QUEUE_LIMIT" in k) for k in env)
    single = minio_notify_env(AmqpSettings(event_delivery="queue_dir"), "amqp://u:p@rabbit:5672", "/queue")
    assert not any(k.endswith(f"_{fast}") for k in single)


def test_a_bucket_is_subscribed_to_both_targets_once_and_back_to_one_when_dual_is_turned_off() -> None:
    arns = AmqpSettings(event_delivery="dual").queue_arns
    assert arns[0] == ARN and len(arns) == 2
    other = QueueConfig(queue="arn:minio:sqs::OTHER:webhook", events=["s3:ObjectCreated:*"], config_id="someone-else")
    client = FakeMinio(NotificationConfig(queue_config_list=[other]))
    assert subscribe_bucket(client, "videos", arns) is True  # type: ignore[arg-type]
    assert subscribe_bucket(client, "videos", arns) is False  # type: ignore[arg-type]
    assert sorted(q.queue for q in client.config.queue_config_list) == sorted([other.queue, *arns])
    assert subscribe_bucket(client, "videos", ARN) is True  # type: ignore[arg-type]
    assert [q.queue for q in client.config.queue_config_list] == [other.queue, ARN]


def arn_refused() -> S3Error:
    return S3Error(
        None,  # type: ignore[arg-type]  # the HTTP response: not read
        "InvalidArgument",
        "A specified destination ARN does not exist or is not well-formed. Verify the destination ARN.",
        "/videos",
        "req",
        "host",
    )


class NotYetOnline(FakeMinio):
    """A fresh distributed MinIO: the first ``refusals`` rules reach a node whose target isn't online."""

    def __init__(self, refusals: int) -> None:
        super().__init__(NotificationConfig())
        self.refusals = refusals

    def set_bucket_notification(self, bucket: str, config: NotificationConfig) -> None:
        if self.refusals:
            self.refusals -= 1
            raise arn_refused()
        super().set_bucket_notification(bucket, config)


def test_a_target_not_yet_online_on_a_fresh_minio_is_asked_again_until_it_is() -> None:
    client, now, slept = NotYetOnline(refusals=3), [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    assert subscribe_bucket(client, "videos", ARN, 60, lambda: now[0], sleep) is True  # type: ignore[arg-type]
    assert client.sets == 1 and slept == [1.0, 1.0, 1.0]


def test_a_target_still_unknown_after_the_wait_is_refused_with_minios_reason() -> None:
    client, now = NotYetOnline(refusals=1000), [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(S3Error, match="destination ARN does not exist"):
        subscribe_bucket(client, "videos", ARN, 10, lambda: now[0], sleep)  # type: ignore[arg-type]
    assert now[0] <= 10 and client.sets == 0


class OneTarget(FakeMinio):
    """A MinIO set up before dual delivery: it knows the durable target only."""

    def __init__(self) -> None:
        super().__init__(NotificationConfig())

    def set_bucket_notification(self, bucket: str, config: NotificationConfig) -> None:
        if any(q.queue != ARN for q in config.queue_config_list):
            raise arn_refused()
        super().set_bucket_notification(bucket, config)


def test_a_minio_without_the_fast_target_is_subscribed_to_the_durable_one_after_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, now = OneTarget(), [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    arns = AmqpSettings(event_delivery="dual").queue_arns
    assert subscribe_bucket(client, "videos", arns, 10, lambda: now[0], sleep) is True  # type: ignore[arg-type]
    assert [q.queue for q in client.config.queue_config_list] == [ARN]
    assert now[0] <= 10
    assert "VIDX_AMQP__EVENT_DELIVERY=queue_dir" in caplog.text and arns[1] in caplog.text


def test_the_fast_target_must_differ_from_the_durable_one() -> None:
    with pytest.raises(ValueError, match="must differ"):
        AmqpSettings(minio_fast_target_id="VIDX")
    assert AmqpSettings(event_delivery="queue_dir", minio_fast_target_id="VIDX").queue_arns == [ARN]
