"""The checker's listing against real MinIO: a resumed round starts after the last key it checked."""

from __future__ import annotations

import io

import pytest

from infra.harness.services import Services, unique_prefix
from pipeline.settings import Settings
from pipeline.upkeep.sources import S3PageLister

pytestmark = pytest.mark.integration


def test_a_listing_resumes_after_a_key(services: Services) -> None:
    prefix = unique_prefix()
    services.prepare_buckets(prefix)
    with pytest.MonkeyPatch.context() as env:
        for name, value in services.env(prefix).items():
            env.setenv(name, value)
        settings = Settings()
    client = services.minio_client()
    bucket = settings.s3.upload_bucket
    keys = [f"p/k{i}.txt" for i in range(5)]
    for key in keys:
        client.put_object(bucket, key, io.BytesIO(b"x"), 1)
    lister = S3PageLister(settings.s3)
    assert [o.key for page in lister.pages(bucket, "p/", None) for o in page] == keys
    assert [o.key for page in lister.pages(bucket, "p/", "p/k2.txt") for o in page] == keys[3:]
    client.set_bucket_versioning(
        bucket, __import__("minio.versioningconfig").versioningconfig.VersioningConfig("Enabled")
    )
    client.put_object(bucket, "p/k1.txt", io.BytesIO(b"yy"), 2)  # a second version of k1
    assert [o.key for page in lister.pages(bucket, "p/", "p/k0.txt") for o in page] == keys[1:]
