"""The e2e fault proxy (weightship_dev.faultproxy) in front of a moto S3 server: it
forwards signed requests unchanged, answers S3 error storms, and counts what it served."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

from weightship.data.s3 import RetryPolicy, S3Location, S3Origin, S3Settings, make_client
from weightship_dev.faultproxy import FaultProxy

DATA = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def proxy(upstream: str) -> Iterator[FaultProxy]:
    p = FaultProxy(upstream).start()
    yield p
    p.stop()


def origin_via(endpoint: str, bucket: str, retry: RetryPolicy | None = None) -> S3Origin:
    client = make_client(
        S3Settings(
            endpoint_url=endpoint, region="us-east-1", access_key_id="k", secret_access_key="s"
        )
    )
    return S3Origin(client, S3Location(bucket, "m/"), retry=retry)


@pytest.fixture
def bucket(upstream: str) -> str:
    name = f"fp-{time.monotonic_ns()}"
    direct = origin_via(upstream, name)
    direct.client.create_bucket(Bucket=name)
    direct.put_bytes("w.bin", DATA)
    return name


def test_signed_requests_pass_through_and_each_answer_is_counted(
    proxy: FaultProxy, bucket: str
) -> None:
    origin = origin_via(proxy.url, bucket)
    assert origin.read_range("w.bin", 1000, 5000) == DATA[1000:6000]
    assert origin.read_bytes("w.bin") == DATA
    assert origin.list_files() == [("w.bin", len(DATA))]
    ranged = proxy.ranged_gets()
    assert [(a.key, a.range, a.status, a.body_bytes) for a in ranged] == [
        (f"/{bucket}/m/w.bin", "bytes=1000-5999", 206, 5000)
    ]
    assert not proxy.served_twice()
    origin.read_range("w.bin", 1000, 5000)
    assert proxy.served_twice() == {(f"/{bucket}/m/w.bin", "bytes=1000-5999"): 2}


def test_a_storm_answers_503_and_500_without_asking_the_upstream(
    proxy: FaultProxy, bucket: str
) -> None:
    proxy.storm(seconds=30)
    assert proxy.storming()
    codes = []
    for _ in range(4):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{proxy.url}/{bucket}/m/w.bin", timeout=5)
        body = err.value.read()
        assert b"<Code>" in body
        codes.append(err.value.code)
    assert sorted(set(codes)) == [500, 503]
    assert all(a.injected and not a.ok for a in proxy.answers())


def test_a_storm_armed_after_n_ranges_starts_then_and_ends_by_itself(
    proxy: FaultProxy, bucket: str
) -> None:
    origin = origin_via(proxy.url, bucket, RetryPolicy(attempts=1))
    proxy.storm(seconds=1.0, after_ranged_gets=2)
    origin.read_range("w.bin", 0, 10)
    assert not proxy.storming()
    origin.read_range("w.bin", 10, 10)
    assert proxy.storming()
    with pytest.raises(Exception, match=r"SlowDown|InternalError"):
        origin.read_range("w.bin", 20, 10)
    while proxy.storming():  # the storm runs out on its own clock
        time.sleep(0.05)
    assert origin.read_range("w.bin", 20, 10) == DATA[20:30]
    window = proxy.storm_window()
    assert window is not None and window[1] - window[0] == pytest.approx(1.0)
    assert [a.ok for a in proxy.ranged_gets()] == [True, True, False, True]


def test_the_origin_retries_through_a_short_storm_and_reads_each_range_once(
    proxy: FaultProxy, bucket: str
) -> None:
    retry = RetryPolicy(attempts=30, initial_backoff_s=0.05, max_backoff_s=0.2)
    origin = origin_via(proxy.url, bucket, retry)
    proxy.storm(seconds=1.5)
    assert origin.read_range("w.bin", 4096, 65536) == DATA[4096 : 4096 + 65536]
    window = proxy.storm_window()
    assert window is not None
    failed = proxy.ranged_gets(ok=False)
    assert failed and {a.status for a in failed} <= {500, 503}
    # Retried through the storm: the one success came after its end (the proxy's own
    # record of when it answered, not a stopwatch in the test).
    assert all(a.at >= window[0] for a in failed)
    assert [a.at >= window[1] for a in proxy.ranged_gets(ok=True)] == [True]
    assert len(proxy.ranged_gets(ok=True)) == 1 and not proxy.served_twice()
