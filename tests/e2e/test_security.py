"""Security of the real Ray Serve app over real MinIO and RabbitMQ: bearer keys on every endpoint but
/healthz, the admin key on /v1/admin/..., only configured s3:// objects indexed, bounded uploads, and
no credential in any log of the run or any error body."""

from __future__ import annotations

import base64
import logging
import os
import secrets
import socket
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from infra.harness.services import SECRET_KEY, Services, eventually, unique_prefix
from infra.harness.shutdown import stop_ray
from pipeline.settings import Settings
from storage.ids import video_id
from tests.harness import report_lines
from tests.media import write_video

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STARTUP_TIMEOUT_S = 240.0
INDEX_TIMEOUT_S = 120.0
#: Less log text than this means the logs were not found: the secret check would pass vacuously. A run
#: writes 180–330 kB here (how much Ray logs varies with timing); the job line of the indexed video
#: is required as well.
MIN_LOG_BYTES = 100_000
VIDEO_KEY = "security/clip one.mp4"


@dataclass
class SecureApp:
    settings: Settings
    services: Services
    http: httpx.Client
    api_key: str
    rotated_key: str
    admin_key: str
    amqp_password: str
    records: list[str]
    bodies: list[str] = field(default_factory=list)

    @property
    def bucket(self) -> str:
        return self.settings.s3.upload_bucket

    def headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def secrets(self) -> dict[str, str]:
        return {
            "S3 secret key": SECRET_KEY,
            "AMQP password": self.amqp_password,
            "API key": self.api_key,
            "rotated API key": self.rotated_key,
            "admin key": self.admin_key,
        }


def _forms(secret: str, users: tuple[str, ...]) -> list[tuple[str, bytes]]:
    """The ways a secret shows up in text besides as written: URL-quoted (in an AMQP URL), base64 (in
    a token) and inside an HTTP Basic header (base64 of ``user:secret`` for each of ``users``)."""
    basic = [base64.b64encode(f"{user}:{secret}".encode()) for user in users]
    return [
        ("as written", secret.encode()),
        ("URL-quoted", urllib.parse.quote(secret, safe="").encode()),
        ("base64", base64.b64encode(secret.encode()).rstrip(b"=")),
        *((f"Basic, user {user!r}", b) for user, b in zip(users, basic, strict=True)),
    ]


class _Records(logging.Handler):
    """Every log record of this process, formatted, with its traceback."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.INFO)
        self._into = into
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self._into.append(self.format(record))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _amqp_user(services: Services, user: str, password: str) -> str:
    """A broker user with a password of its own (guest's password is its name: useless to grep for)."""
    api = services.management_url
    auth = ("guest", "guest")
    httpx.put(f"{api}/api/users/{user}", json={"password": password, "tags": ""}, auth=auth).raise_for_status()
    perms = {"configure": ".*", "write": ".*", "read": ".*"}
    httpx.put(f"{api}/api/permissions/%2F/{user}", json=perms, auth=auth).raise_for_status()
    host_port = services.amqp_url.split("@", 1)[1]
    return f"amqp://{user}:{password}@{host_port}"


@pytest.fixture(scope="module")
def secure(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureApp]:
    import ray
    from ray import serve

    from pipeline.serve.app import build_app

    prefix = unique_prefix()
    services.prepare_buckets(prefix)
    state = tmp_path_factory.mktemp("state")
    api_key, rotated_key, admin_key = (secrets.token_urlsafe(32) for _ in range(3))
    key_file = state / "api-key"
    key_file.write_text(api_key + "\n")
    key_file.chmod(0o600)
    amqp_password = f"amqp-pw-{uuid.uuid4().hex}"
    env = {
        **services.env(prefix),
        "VIDX_AMQP__URL": _amqp_user(services, f"{prefix}-app", amqp_password),
        "VIDX_MODEL__ID": str(tiny_model_dir),
        "VIDX_STATE_DIR": str(state),
        "VIDX_SERVE__PORT": str(_free_port()),
        # One key from a file (as 'vidx up' hands it over), one more for rotation, and the admin key.
        "VIDX_API_KEY_FILE": str(key_file),
        "VIDX_API_KEYS": f'["{rotated_key}"]',
        "VIDX_ADMIN_KEY": admin_key,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    records: list[str] = []
    handler = _Records(records)
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        settings = Settings()
        assert len(settings.api_keys) == 2 and settings.admin_key is not None
        ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
        serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        serve.run(build_app(settings), name=settings.serve.app_name, route_prefix="/", blocking=False)
        bodies: list[str] = []

        def keep_body(response: httpx.Response) -> None:
            response.read()
            bodies.append(response.text)

        with httpx.Client(base_url=settings.api_url, timeout=60, event_hooks={"response": [keep_body]}) as http:

            def healthy() -> bool:
                try:
                    return http.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    return False

            eventually(healthy, "the API to answer /healthz", STARTUP_TIMEOUT_S)
            auth = {"Authorization": f"Bearer {api_key}"}
            eventually(
                lambda: http.get("/metrics", headers=auth).text.count("\nvidx_router_connected 1.0") == 1,
                "the event router to connect",
                60,
            )
            yield SecureApp(settings, services, http, api_key, rotated_key, admin_key, amqp_password, records, bodies)
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)
        try:
            stop_ray(serve_first=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


GUARDED = [
    ("GET", "/v1/search?q=dog"),
    ("GET", "/v1/videos"),
    ("GET", "/v1/videos/v0"),
    ("POST", "/v1/index"),
    ("POST", "/v1/search/image"),
    ("GET", "/v1/frames/f0/thumbnail"),
    ("POST", "/v1/uploads"),
    ("GET", "/metrics"),
    ("GET", "/docs"),
    ("GET", "/v1/admin/dlq"),
]


def test_unauthenticated_and_wrong_keys_get_401(secure: SecureApp) -> None:
    assert secure.http.get("/healthz").json() == {"status": "ok"}
    for method, path in GUARDED:
        for headers in ({}, secure.headers("wrong-" + secure.api_key), {"Authorization": secure.api_key}):
            resp = secure.http.request(method, path, headers=headers)
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.json()["error"]["code"] == "unauthorized"
            assert resp.headers["www-authenticate"].startswith("Bearer")


def test_each_key_opens_the_api(secure: SecureApp) -> None:
    for key in (secure.api_key, secure.rotated_key, secure.admin_key):
        resp = secure.http.get("/v1/videos", headers=secure.headers(key))
        assert resp.status_code == 200, resp.text


def test_admin_paths_need_the_admin_key(secure: SecureApp) -> None:
    for path in ("/v1/admin/dlq", "/v1/admin/reindex"):
        regular = secure.http.get(path, headers=secure.headers(secure.api_key))
        assert regular.status_code == 403 and regular.json()["error"]["code"] == "forbidden"
        assert secure.http.get(path, headers=secure.headers(secure.rotated_key)).status_code == 403
        assert secure.http.get(path, headers=secure.headers(secure.admin_key)).status_code not in (401, 403)


def test_only_configured_s3_objects_are_indexed(secure: SecureApp) -> None:
    auth = secure.headers(secure.api_key)
    for uri in (
        "file:///etc/passwd",
        "http://169.254.169.254/latest/meta-data/",
        f"https://minio/{secure.bucket}/a.mp4",
        "s3://some-other-bucket/a.mp4",
        f"s3://{secure.settings.s3.index_bucket}/lancedb/frames.lance",
        f"s3://{secure.bucket}/../{secure.settings.s3.index_bucket}/x",
        f"s3://{secure.bucket}/a/%2e%2e/b.mp4",
        f"s3://{secure.bucket}/a%2Fb.mp4",
        f"s3://{secure.bucket}/a\\b.mp4",
        f"s3://{secure.bucket}/a\x00.mp4",
    ):
        resp = secure.http.post("/v1/index", json={"uri": uri}, headers=auth)
        assert resp.status_code == 400, (uri, resp.text)
        assert resp.json()["error"]["code"] == "bad_request"


def test_a_40_mb_image_is_413(secure: SecureApp) -> None:
    big = os.urandom(40 * 1024 * 1024)
    resp = secure.http.post(
        "/v1/search/image", files={"image": ("big.png", big, "image/png")}, headers=secure.headers(secure.api_key)
    )
    assert resp.status_code == 413, resp.text[:300]
    assert resp.json()["error"]["code"] == "too_large"
    # The same image streamed without a length (chunked) is cut off while it is read.
    head = b'--x\r\nContent-Disposition: form-data; name="image"; filename="big.png"\r\n\r\n'

    def stream() -> Iterator[bytes]:
        yield head
        for i in range(0, len(big), 1024 * 1024):
            yield big[i : i + 1024 * 1024]
        yield b"\r\n--x--\r\n"

    chunked = secure.http.post(
        "/v1/search/image",
        content=stream(),
        headers={**secure.headers(secure.api_key), "Content-Type": "multipart/form-data; boundary=x"},
    )
    assert chunked.status_code == 413, chunked.text[:300]


def test_a_long_query_and_a_large_k_are_refused(secure: SecureApp) -> None:
    auth = secure.headers(secure.api_key)
    long_q = secure.http.get("/v1/search", params={"q": "x" * 10_000}, headers=auth)
    assert long_q.status_code == 413
    assert secure.http.get("/v1/search", params={"q": "dog", "k": 10_000}, headers=auth).status_code == 400


def test_indexing_and_search_work_with_a_key(secure: SecureApp, tmp_path: Path) -> None:
    auth = secure.headers(secure.api_key)
    path = write_video(tmp_path / "clip.mp4", seconds=3, seed=700)
    # The bucket event and POST /v1/index both queue it: jobs are idempotent, either may index it.
    secure.services.minio_client().fput_object(secure.bucket, VIDEO_KEY, str(path), content_type="video/mp4")
    resp = secure.http.post("/v1/index", json={"uri": f"s3://{secure.bucket}/{VIDEO_KEY}"}, headers=auth)
    assert resp.status_code == 202, resp.text
    vid = resp.json()["video_id"]
    assert vid == video_id(secure.bucket, VIDEO_KEY)

    def indexed() -> bool:
        return secure.http.get(f"/v1/videos/{vid}", headers=auth).json().get("status") == "indexed"

    eventually(indexed, "the video to be indexed", INDEX_TIMEOUT_S, poll_s=0.5)
    found = secure.http.get("/v1/search", params={"q": "a clip", "k": 3}, headers=auth)
    assert found.status_code == 200 and found.json()["results"]
    link = found.json()["results"][0]["video_url"]
    expires = int(httpx.URL(link.split("#")[0]).params["X-Amz-Expires"])
    assert expires == secure.settings.s3.presign_ttl_s <= 3600


def _log_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            yield path


@pytest.fixture(scope="module")
def summary(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Lines for the terminal report, written when the module is done (capfd holds the test's output)."""
    lines: list[str] = []
    yield lines
    report_lines(request.config, lines)


def test_zz_no_secret_in_any_log_or_error_body(
    secure: SecureApp, capfd: pytest.CaptureFixture[str], summary: list[str]
) -> None:
    """Runs last in this module: reads every log the run wrote and every body the API answered."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())  # type: ignore[attr-defined]
    texts: dict[str, bytes] = {}
    for path in _log_files(session / "logs"):
        texts[str(path)] = path.read_bytes()
    texts["log records of this process"] = "\n".join(secure.records).encode()
    out, err = capfd.readouterr()
    texts["stdout/stderr of this test"] = (out + err).encode()
    texts["API response bodies"] = "\n".join(secure.bodies).encode()
    total = sum(len(t) for t in texts.values())
    assert total > MIN_LOG_BYTES, f"only {total} bytes of logs read from {session}/logs: the check would be vacuous"
    # The logs read are the app's own: the consumer logged the job of the indexed video.
    assert any(VIDEO_KEY.encode() in t and b"indexed" in t for t in texts.values()), "no app log found"
    assert len(secure.bodies) > 50
    amqp_user = urllib.parse.urlsplit(secure.settings.amqp.url.get_secret_value()).username or ""
    users = (amqp_user, "guest", "minioadmin", "")
    forms = {
        f"{what} ({form})": value for what, secret in secure.secrets.items() for form, value in _forms(secret, users)
    }
    leaks = [f"{what} in {where}" for where, text in texts.items() for what, value in forms.items() if value in text]
    assert not leaks, leaks
    summary.append(
        f"security: no secret in {total} bytes: {len(texts) - 3} Ray log files, {len(secure.records)} log "
        f"records, this test's output, {len(secure.bodies)} response bodies ({len(secure.secrets)} secrets, "
        f"{len(forms)} forms: as written, URL-quoted, base64, in a Basic header)"
    )
