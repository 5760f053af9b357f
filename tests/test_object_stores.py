"""Object stores: arrays in a real S3 API server (moto's, on loopback), in Azurite (Azure's
blob storage emulator, when installed: ``npm install azurite``), in gcp-storage-emulator
(GCS's; tests/gcs_emulator.py) and on an HTTP server
answering Range requests, read by damacy.read, embedded pipelines and damacyd, compared
with what zarr-python reads from the same files."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import damacy
from damacy_server.store.fetch import Fetcher
from damacy_server.store.remote import RemoteStores, is_remote, normalized

from conftest import random_data, write_array
from daemon_helpers import DaemonProcess, wait_for
from object_servers import AzuriteServer, GcsServer, RangeServer, S3Server, azurite_command

pytest.importorskip("obstore")
pytest.importorskip("moto")

_buckets = itertools.count()


@pytest.fixture(scope="module")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 API server, with the standard AWS_* variables pointing at it for this test."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(scope="module")
def azurite_server():
    command = azurite_command()
    if command is None:
        pytest.skip("Azurite is not installed (npm install azurite, as .ci/run does; or DAMACY_AZURITE=path/to/azurite-blob)")
    server = AzuriteServer(command)  # installed: a failure to start fails the tests
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gcs_server():
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator is not installed (it is in the test extra)")
    server = GcsServer()  # installed: a failure to start fails the tests
    yield server
    server.stop()


@pytest.fixture(params=["s3", "az", "gs"])
def objects(request, monkeypatch):
    """Each object store server in turn (S3: moto's; Azure: Azurite; GCS:
    gcp-storage-emulator), with the environment its clients read pointing at it for this
    test."""
    server = request.getfixturevalue({"s3": "s3_server", "az": "azurite_server", "gs": "gcs_server"}[request.param])
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return server


def _bucket(s3) -> str:
    return s3.bucket(f"damacy-{os.getpid()}-{next(_buckets)}")


@pytest.fixture
def sharded(tmp_path):
    """A sharded zstd array with one shard and some inner chunks never written."""
    data = random_data((60, 50), "uint16", seed=3)
    arr = write_array(tmp_path / "a.zarr", data, chunks=(6, 5), shards=(30, 25), compressors=[ZstdCodec(level=3)], fill_value=7)
    arr[30:60, 25:50] = 7  # a whole shard of fill: zarr-python writes no object
    arr[0:6, 0:5] = 7  # an inner chunk of fill: an empty entry in the shard index
    return tmp_path, zarr.open_array(str(tmp_path / "a.zarr"), mode="r")[...]


def _boxes(shape, n, size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = [int(rng.integers(0, s - k + 1)) for s, k in zip(shape, size)]
        out.append(tuple(slice(a, a + k) for a, k in zip(start, size)))
    return out


# -- S3 ------------------------------------------------------------------------------
def test_boxes_of_a_sharded_array_in_a_bucket_match_zarr(objects, sharded):
    folder, expected = sharded
    bucket = _bucket(objects)
    objects.upload(folder, bucket, "data")
    uri = f"{objects.scheme}://{bucket}/data/a.zarr"
    assert not any(p.name == "1.1" for p in folder.rglob("*"))  # the fill shard has no object
    np.testing.assert_array_equal(damacy.read(uri), expected)
    np.testing.assert_array_equal(damacy.read(uri, np.s_[3:41, 7:33]), expected[3:41, 7:33])
    boxes = _boxes(expected.shape, 24, (12, 10), seed=1)
    cfg = damacy.Config(samples_per_batch=5, sample_shape=(12, 10), dtype="u16", max_memory_bytes=64 << 20, drop_last=False)
    got = []
    with damacy.Pipeline(cfg) as p:
        p.push(damacy.Sample(uri, b) for b in boxes)
        for batch in p:
            got.extend(np.array(np.from_dlpack(batch)))
        reads = p.stats_dict()["stages"]["read"]["count"]
    assert len(got) == len(boxes) and reads > 0
    for box, sample in zip(boxes, got):
        np.testing.assert_array_equal(sample, expected[box])


def test_an_array_written_again_in_a_bucket_is_read_anew(objects, tmp_path):
    """damacy.read's metadata cache outlives a read: the array's document is asked for its
    version (a HEAD) before each read, and an array uploaded again is read anew."""
    if objects.scheme == "gs":
        pytest.skip("gcp-storage-emulator answers HEAD with 501: it gives no versions (GCS itself does)")
    bucket = _bucket(objects)
    uri = f"{objects.scheme}://{bucket}/data/a.zarr"
    # the two compress to other sizes: the first's shard index places the second's chunks wrong.
    # (An object's version is its ETag, a digest of its bytes, and its time, in seconds: the
    # second's zarr.json differs by an attribute, as a dataset's writer that stamps its runs
    # does; one the same to the byte is seen as new a second or more later.)
    for run, data in enumerate([(np.arange(1200, dtype="uint16") % 7).reshape(40, 30), random_data((40, 30), "uint16")]):
        folder = tmp_path / str(run)
        arr = write_array(folder / "a.zarr", data, chunks=(10, 10), shards=(20, 30), compressors=[ZstdCodec(level=3)])
        arr.attrs["run"] = run
        objects.upload(folder, bucket, "data")
        np.testing.assert_array_equal(damacy.read(uri, np.s_[3:17, 4:25]), data[3:17, 4:25])  # by the shard index


def test_a_missing_array_in_a_bucket_is_named(objects):
    bucket = _bucket(objects)
    with pytest.raises(damacy.NotFound, match=rf"{objects.scheme}://{bucket}/nothing\.zarr: no Zarr array"):
        damacy.read(f"{objects.scheme}://{bucket}/nothing.zarr", np.s_[0:1])


def test_missing_objects_in_a_bucket_read_as_fill(objects, tmp_path):
    data = np.arange(400, dtype="float32").reshape(20, 20)
    write_array(tmp_path / "f.zarr", data, chunks=(5, 5), compressors=[BloscCodec(cname="lz4", shuffle="shuffle")], fill_value=-1.0)
    (tmp_path / "f.zarr" / "c" / "1" / "2").unlink()  # a chunk object never written
    bucket = _bucket(objects)
    objects.upload(tmp_path, bucket, "")
    expected = data.copy()
    expected[5:10, 10:15] = -1
    np.testing.assert_array_equal(damacy.read(f"{objects.scheme}://{bucket}/f.zarr"), expected)


def test_the_conformance_corpus_from_a_bucket(objects, conformance_dir):
    from test_conformance import read_corpus

    bucket = _bucket(objects)
    for store_set in sorted(p for p in conformance_dir.iterdir() if p.is_dir() and p.name != "expected"):  # the values stay local
        objects.upload(store_set, bucket, f"corpus/{store_set.name}")
    matched, refused, failures, must_read = read_corpus(
        conformance_dir, lambda path: f"{objects.scheme}://{bucket}/corpus/{path.relative_to(conformance_dir).as_posix()}", workers=8
    )
    assert not failures, "\n".join(failures)
    assert sorted(matched) == sorted(must_read) and refused


@pytest.mark.parametrize("scheme", ["s3", "az", "gs"])
def test_an_unreachable_server_is_named_with_the_cause(scheme, monkeypatch):
    from object_servers import AZURITE_ACCOUNT, AZURITE_KEY, S3_ENV, _free_port

    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    env = {
        "s3": {**S3_ENV, "AWS_ENDPOINT_URL": dead},
        "az": {"AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY, "AZURE_STORAGE_USE_EMULATOR": "true",
               "AZURITE_BLOB_STORAGE_URL": dead, "AZURE_ALLOW_HTTP": "true"},
        "gs": {"GOOGLE_BASE_URL": dead, "GOOGLE_SKIP_SIGNATURE": "true", "GOOGLE_ALLOW_HTTP": "true"},
    }[scheme]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    uri = f"{scheme}://nowhere-{os.getpid()}/a.zarr"
    with pytest.raises(damacy.StorageError, match=rf"{uri}/zarr.json: could not reach the server \(tcp connect error to 127.0.0.1:\d+: Connection refused\)"):
        damacy.read(uri, np.s_[0:1])


def test_a_daemon_refuses_a_bucket_outside_its_prefixes_before_making_a_store_for_it():
    # a refusal costs no client configuration and keeps nothing: a client naming many buckets
    # does not grow the daemon or hold up its loop
    from damacy_server.store.remote import RemoteStores

    remote = RemoteStores(allow=["s3://data/train"])
    for k in range(50):
        with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed prefixes"):
            remote.resolve(f"s3://bucket-{k}/a.zarr")
    with pytest.raises(damacy.InvalidArgument, match="serves no object stores"):
        RemoteStores(allow=[]).resolve("s3://data/train/a.zarr")
    assert not remote._stores
    store, key = remote.resolve("s3://data/train/a.zarr")
    assert key == "s3://data/train/a.zarr" and len(remote._stores) == 1


def test_the_disk_tier_keys_name_the_endpoint(monkeypatch):
    # one bucket name on two servers holds two sets of objects: a tier shared by both never
    # serves one's bytes for the other's
    from damacy_server.store.remote import RemoteStores

    for name in [n for n in os.environ if n.startswith("AWS_") and ("ENDPOINT" in n or n.endswith("URL"))]:
        monkeypatch.delenv(name)
    key = "s3://bucket/a.zarr/c/0/0"
    cloud = RemoteStores().resolve(key)[0]
    minio = RemoteStores({"s3://bucket": {"endpoint": "http://127.0.0.1:9000"}}).resolve(key)[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    local = RemoteStores().resolve(key)[0]
    names = [cloud.cache_key(key), minio.cache_key(key), local.cache_key(key)]
    assert names[0] == key and len(set(names)) == 3 and "127.0.0.1:9000" in names[1]


def test_an_array_written_again_is_not_read_from_the_disk_tiers_old_entries(s3, tmp_path):
    """The disk tier outlives runs: its entries are named by the version of their array's
    metadata, so a run after the array was uploaded again (its chunks at the same ranges:
    noise compresses to the same sizes) fetches the new bytes instead of the old entries."""
    bucket = _bucket(s3)
    uri = f"s3://{bucket}/data/a.zarr"
    tier = tmp_path / "tier"
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(10, 30), dtype="u16", chunk_cache_dir=str(tier))
    samples = [damacy.Sample(uri, np.s_[z : z + 10, :]) for z in range(0, 40, 10)]
    for run in range(2):
        data = random_data((40, 30), "uint16", seed=run)
        arr = write_array(tmp_path / str(run) / "a.zarr", data, chunks=(10, 10), shards=(20, 30), compressors=[ZstdCodec(level=3)])
        arr.attrs["run"] = run  # the writer stamps its runs: another zarr.json, another ETag
        s3.upload(tmp_path / str(run), bucket, "data")
        with damacy.Pipeline(cfg) as p:
            p.push(samples)
            with p.pop() as b:
                np.testing.assert_array_equal(b.numpy(), data.reshape(4, 10, 30))
            wait_for(lambda p=p: p.stats_dict()["disk_cache"]["writes"] >= 2, what="the fetched shards on disk")
            disk = p.stats_dict()["stages"].get("disk", {}).get("count", 0)
        assert disk == 0  # each run's bytes were fetched, none taken from the tier


def test_storage_options_name_the_endpoint_without_the_environment(s3_server, sharded, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    folder, expected = sharded
    bucket = _bucket(s3_server)
    s3_server.upload(folder, bucket, "x")
    options = {f"s3://{bucket}": {
        "endpoint": s3_server.endpoint, "allow_http": "true", "access_key_id": "testing",
        "secret_access_key": "testing", "region": "us-east-1",
    }}
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4), dtype="u16", storage_options=options)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(f"s3://{bucket}/x/a.zarr", np.s_[10:14, 20:24])])
        np.testing.assert_array_equal(np.from_dlpack(p.pop())[0], expected[10:14, 20:24])
    with pytest.raises(damacy.InvalidArgument, match="storage options for s3://"):
        with damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(1, 1), storage_options={f"s3://{bucket}": {"no_such_option": "1"}})) as p:
            p.push([damacy.Sample(f"s3://{bucket}/x/a.zarr", np.s_[0:1, 0:1])])
            p.pop()


# -- HTTP ----------------------------------------------------------------------------
@pytest.fixture
def http(tmp_path):
    server = RangeServer(tmp_path)
    yield server
    server.stop()


def test_http_range_reads_match_zarr(http, sharded):
    _, expected = sharded
    uri = f"{http.url}/a.zarr"
    np.testing.assert_array_equal(damacy.read(uri, np.s_[2:59, 1:48]), expected[2:59, 1:48])
    ranged = [s for s in http.statuses("/a.zarr/c/0/0") if s == 206]
    assert ranged, "shards are read by byte range"


def test_http_5xx_is_retried_until_it_succeeds(http, sharded):
    _, expected = sharded
    http.fail["/a.zarr/c/0/1"] = [500, 503]
    got = damacy.read(f"{http.url}/a.zarr", np.s_[0:30, 25:50])
    np.testing.assert_array_equal(got, expected[0:30, 25:50])
    statuses = http.statuses("/a.zarr/c/0/1")
    assert statuses[:2] == [500, 503] and 206 in statuses[2:]


def test_http_error_names_the_object_and_status(http, sharded):
    http.fail["/a.zarr/c/0/1"] = [403] * 10
    with pytest.raises(damacy.StorageError) as info:
        damacy.read(f"{http.url}/a.zarr", np.s_[0:30, 25:50])
    assert "HTTP 403" in str(info.value) and info.value.path.endswith("/a.zarr/c/0/1")
    assert info.value.uri == f"{http.url}/a.zarr"


def test_a_range_past_the_end_is_short_and_a_failure_is_not_taken_for_one(http, sharded):
    """A server refuses a range that starts past the object's end (416): the read is short,
    as a file's, decided by the object's size; a failing server is a StorageError naming the
    object and status, never taken for a range past the end."""
    from damacy_server.store import resolve_uri

    folder, _ = sharded
    key = f"{http.url}/a.zarr/c/0/0"
    size = (folder / "a.zarr" / "c" / "0" / "0").stat().st_size
    store, _ = resolve_uri(key)
    assert store.read_range_sized(key, size + 10, 4) == (b"", size)
    assert store.read_range(key, size, 4) == b"" and 416 in http.statuses("/a.zarr/c/0/0")
    assert store.read_ranges_sized([key, f"{http.url}/a.zarr/c/0/1"], size + 10, 4, most=2)[0] == (b"", size)
    assert store.read_range_sized(f"{http.url}/a.zarr/c/9/9", 0, 4) is None
    http.fail["/a.zarr/c/0/0"] = [403] * 10
    with pytest.raises(damacy.StorageError, match="HTTP 403") as info:
        store.read_range_sized(key, 0, 4)
    assert info.value.path == key
    # a GET that failed (not its range) is reported as the GET's failure, with no HEAD after it
    for status in (403, 500):
        http.fail["/a.zarr/c/0/0"] = [status] * 10
        asked = len(http.requests)
        with pytest.raises(damacy.StorageError, match=f"HTTP {status}.*GET") as info:
            store.read_range(key, 0, 4)
        assert [m for m, p, _ in http.requests[asked:] if p == "/a.zarr/c/0/0"] == ["GET"] * (1 if status == 403 else 4)


def test_a_stalled_server_times_out_and_the_other_samples_go_on(http, sharded):
    _, expected = sharded
    uri = f"{http.url}/a.zarr"
    damacy.open_array(uri, metadata=(md := damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())))
    http.stall.add("/a.zarr/c/1/0")
    options = {http.url: {"timeout": "5s", "max_retries": "0"}}  # the other samples' requests must finish within it
    cfg = damacy.Config(samples_per_batch=3, sample_shape=(5, 5), dtype="u16", on_error="fill", storage_options=options)
    boxes = [np.s_[0:5, 0:5], np.s_[40:45, 0:5], np.s_[10:15, 30:35]]  # the second is in the stalled shard
    with damacy.Pipeline(cfg) as p:
        p.push(damacy.Sample(uri, b) for b in boxes)
        batch = p.pop()
        got = np.from_dlpack(batch)
        errors = dict(batch.info.errors)
    assert http.stalled.wait(60)  # the request that timed out may reach its handler only after the client gave up
    assert list(errors) == [1]
    assert isinstance(errors[1], damacy.StorageError) and "timed out" in str(errors[1]) and "c/1/0" in str(errors[1])
    np.testing.assert_array_equal(got[0], expected[0:5, 0:5])
    np.testing.assert_array_equal(got[2], expected[10:15, 30:35])
    del md


def test_reads_wait_without_the_gil(http, sharded):
    """A read stalled at the server leaves this thread running Python: the server is let go
    only from here, so a read holding the GIL would time out instead of returning data."""
    _, expected = sharded
    http.stall.add("/a.zarr/c/0/0")
    out: dict = {}

    def reader():
        try:
            out["data"] = damacy.read(f"{http.url}/a.zarr", np.s_[0:5, 0:5])
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=reader)
    t.start()
    assert http.stalled.wait(30)
    count = sum(i * i for i in range(200_000))  # Python work while the read waits
    http.release.set()
    t.join(60)
    assert count > 0 and "error" not in out, out
    np.testing.assert_array_equal(out["data"], expected[0:5, 0:5])


# -- uris, merging, the window ---------------------------------------------------------
@pytest.mark.parametrize(
    "uri, message",
    [
        ("s3://bucket/a/../b", r"'\.\.' segment"),
        ("s3://bucket/a/%2e%2e/b", r"'\.\.' segment"),
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/a?versionId=3", "no query"),
        ("s3://user:pw@bucket/a", "credentials"),
        ("s3:///a", "no bucket"),
    ],
)
def test_remote_uris_a_prefix_check_could_be_fooled_by_are_refused(uri, message):
    with pytest.raises(damacy.InvalidArgument, match=message):
        damacy.read(uri, np.s_[0:1])


def test_unsupported_schemes_name_the_supported_ones():
    with pytest.raises(damacy.UnsupportedOperation, match=r"'ftp'://.*s3://.*https://.*icechunk\+file:// and icechunk\+s3://"):
        damacy.read("ftp://host/a.zarr", np.s_[0:1])


def test_prefixes_are_checked_on_every_key():
    stores = RemoteStores(allow=["s3://bucket/allowed"])
    store, root = stores.resolve("s3://bucket/allowed/a.zarr")
    assert root == "s3://bucket/allowed/a.zarr" and normalized("S3://bucket/x/") == "s3://bucket/x"
    with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed prefixes"):
        stores.resolve("s3://bucket/allowedx/a.zarr")  # a prefix is a folder, not a string prefix
    with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed prefixes"):
        store.read("s3://bucket/other/zarr.json")
    with pytest.raises(damacy.InvalidArgument, match=r"'\.\.'"):
        store.join(root, "../../other")
    with pytest.raises(damacy.InvalidArgument, match="serves no object stores"):
        RemoteStores(allow=[]).resolve("s3://bucket/a.zarr")


def test_remote_reads_merge_across_larger_gaps():

    from damacy_server.plan.reads import PlanLimits, merge_reads
    from damacy_server.plan.units import UnitBlock

    def block(key, offsets):
        n = len(offsets)
        return UnitBlock(
            None, None, 0, np.zeros((n, 1), np.int64), [key], np.zeros(n, np.int64), np.asarray(offsets, np.int64),
            np.full(n, 1000, np.int64), np.zeros(n + 1, np.int64), list(range(n)),
        )

    gap = 200 << 10  # more than a local disk's gap, less than a remote one's
    local = block("/data/s", [0, gap])
    remote = block("s3://b/s", [0, gap])
    assert is_remote("s3://b/s") and not is_remote("/data/s")
    assert len(merge_reads(local, PlanLimits())[0]) == 2
    assert len(merge_reads(remote, PlanLimits())[0]) == 1


def test_the_fetch_window_follows_bandwidth_times_latency():
    """Requests of a fake link: each takes 5 ms, and the link carries at most ``lanes`` at
    once. The window grows past its start while it limits the rate, and settles within a
    small multiple of the link's bandwidth-delay product (``lanes``) once the link is full."""
    lanes = 48
    fetcher = Fetcher(min_inflight=4, max_inflight=4096)
    link = None
    done = threading.Event()
    finished = itertools.count(1)
    total = 3000

    async def request():
        nonlocal link
        if link is None:
            link = asyncio.Semaphore(lanes)
        async with link:
            await asyncio.sleep(0.005)
        return b"x" * 1000

    def landed(result, error):
        assert error is None and len(result) == 1000
        if next(finished) == total:
            done.set()

    try:
        for i in range(total):
            fetcher.submit(i, request, landed)
        assert done.wait(120)
        assert fetcher.most_inflight > 4 * 4  # it grew
        assert fetcher.window <= 8 * lanes  # and stopped near the link's capacity
    finally:
        fetcher.close()


# -- damacyd ---------------------------------------------------------------------------
def test_damacyd_serves_allowed_prefixes_only(objects, sharded, tmp_path_factory):
    folder, expected = sharded
    bucket = _bucket(objects)
    objects.upload(folder, bucket, "allowed")
    objects.upload(folder, bucket, "private")
    env = {**os.environ, **objects.env}
    scheme = objects.scheme
    d = DaemonProcess(tmp_path_factory.mktemp("d"), [], ["--allow-prefix", f"{scheme}://{bucket}/allowed"], env=env)
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), dtype="u16", on_error="fill")
        with damacy.Pipeline(cfg, endpoint=d.endpoint) as p:
            p.push([
                damacy.Sample(f"{scheme}://{bucket}/allowed/a.zarr", np.s_[8:12, 9:13]),
                damacy.Sample(f"{scheme}://{bucket}/private/a.zarr", np.s_[8:12, 9:13]),
            ])
            batch = p.pop()
            got = np.from_dlpack(batch)
            errors = dict(batch.info.errors)
        np.testing.assert_array_equal(got[0], expected[8:12, 9:13])
        assert list(errors) == [1] and "outside the daemon's allowed prefixes" in str(errors[1])
        started = d.log_path.read_text()  # the start-up line says what it serves and how
        assert f"prefixes {scheme}://{bucket}/allowed" in started and "roots none" in started and "native decode path" in started
        options = {f"{scheme}://{bucket}": {"region": "x"}}
        with pytest.raises(damacy.InvalidArgument, match="storage_options applies to embedded pipelines"):
            damacy.Pipeline(damacy.Config(samples_per_batch=2, sample_shape=(4, 4), storage_options=options), endpoint=d.endpoint)
    finally:
        assert d.stop() == 0, d.log_path.read_text()


def test_shard_indexes_of_a_remote_array_are_requested_together(http, sharded):
    """While one shard's index request stalls at the server, the others are requested: the
    planner asks for every outer shard's index it lacks at once, not one round trip each."""
    _, expected = sharded
    http.stall.add("/a.zarr/c/0/0")
    out: dict = {}
    uri = f"{http.url}/a.zarr"
    damacy.open_array(uri, metadata=(md := damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())))
    t = threading.Thread(target=lambda: out.update(data=damacy.read(uri, metadata=md)))
    t.start()
    try:
        assert http.stalled.wait(30)
        wait_for(lambda: all(http.statuses(f"/a.zarr/c/{k}") for k in ("0/1", "1/0", "1/1")), what="the other shards' index requests")
    finally:
        http.release.set()
        t.join(60)
    np.testing.assert_array_equal(out["data"], expected)


def test_the_metadata_readers_concurrency_is_the_window_of_index_requests(http, sharded):
    """FileMetadataReader(concurrency=2): the planner keeps two shard-index requests in
    flight, never more (all four shards' stall until two are waiting)."""
    _, expected = sharded
    http.stall.update(f"/a.zarr/c/{k}" for k in ("0/0", "0/1", "1/0", "1/1"))
    uri = f"{http.url}/a.zarr"
    md = damacy.ZarrMetadata(reader=damacy.FileMetadataReader(concurrency=2), cache=damacy.MetadataCache())
    damacy.open_array(uri, metadata=md)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(data=damacy.read(uri, metadata=md)))
    t.start()
    try:
        wait_for(lambda: sum(1 for r in http.requests if r[2] == 0) >= 2, what="two index requests waiting")
    finally:
        http.release.set()
        t.join(60)
    np.testing.assert_array_equal(out["data"], expected)
    assert http.suffix_peak == 2


def test_the_readme_example_runs(s3, tmp_path):
    from test_readme import block

    data = random_data((128, 64, 64), "uint16", seed=5)
    write_array(tmp_path / "brain.zarr", data, chunks=(16, 32, 32), shards=(64, 64, 64), compressors=[ZstdCodec()])
    bucket = _bucket(s3)
    s3.upload(tmp_path, bucket, "volumes")
    scope: dict = {}
    exec(compile(block("objectstores").replace("s3://bucket", f"s3://{bucket}"), "README object stores", "exec"), scope)
    np.testing.assert_array_equal(scope["x"], data[0:64, 0:64, 0:64])
    got = np.concatenate(scope["batches"])
    assert got.dtype == np.float32 and len(got) == 8
    for k, z in enumerate(range(0, 128, 16)):
        expected = np.zeros((32, 64, 64), "f4")  # past the end: the fill value (pipelines pad)
        expected[: len(data[z : z + 32])] = data[z : z + 32]
        np.testing.assert_array_equal(got[k], expected)


# -- consolidated metadata ----------------------------------------------------------------
def _ngff(folder, zarr_format):
    """An NGFF image of two levels written by zarr-python, its metadata consolidated."""
    data = random_data((16, 24), "uint16", seed=9)
    g = zarr.open_group(str(folder / "img.zarr"), mode="w", zarr_format=zarr_format)
    for k, step in enumerate((1, 2)):
        a = g.create_array(str(k), shape=data[::step, ::step].shape, chunks=(8, 8), dtype="u2")
        a[...] = data[::step, ::step]
    axes = [{"name": "y", "type": "space"}, {"name": "x", "type": "space"}]
    datasets = [{"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": [s, s]}]} for k, s in enumerate((1.0, 2.0))]
    multiscales = [{"version": "0.4", "axes": axes, "datasets": datasets}]
    g.attrs.update({"multiscales": multiscales} if zarr_format == 2 else {"ome": {"version": "0.5", "multiscales": multiscales}})
    zarr.consolidate_metadata(str(folder / "img.zarr"))
    return data


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
@pytest.mark.parametrize("zarr_format, own", [(3, "zarr.json"), (2, ".zarray")])
def test_an_images_consolidated_metadata_spares_its_levels_requests(http, tmp_path, zarr_format, own):
    data = _ngff(tmp_path, zarr_format)
    md = damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())
    image = damacy.open_image(f"{http.url}/img.zarr", metadata=md)
    assert [lv.shape for lv in image.levels] == [(16, 24), (8, 12)]
    np.testing.assert_array_equal(damacy.read(f"{http.url}/img.zarr", level=1, metadata=md), data[::2, ::2])
    np.testing.assert_array_equal(damacy.read(f"{http.url}/img.zarr/0", np.s_[3:9, 2:20], metadata=md), data[3:9, 2:20])
    assert not http.statuses(f"/img.zarr/0/{own}") and not http.statuses(f"/img.zarr/1/{own}")


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
@pytest.mark.parametrize("zarr_format, own", [(3, "zarr.json"), (2, ".zarray")])
def test_consolidated_metadata_is_what_a_level_is_read_by(tmp_path, zarr_format, own):
    """With the level's own metadata gone, the image still reads: the consolidated copy
    in the group is the one used (as zarr-python does)."""
    data = _ngff(tmp_path, zarr_format)
    (tmp_path / "img.zarr" / "1" / own).unlink()
    md = damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())
    np.testing.assert_array_equal(damacy.read(str(tmp_path / "img.zarr"), level=1, metadata=md), data[::2, ::2])
    with pytest.raises(damacy.NotFound):
        damacy.read(str(tmp_path / "img.zarr" / "1"), metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))  # no group loaded first


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
def test_an_array_named_directly_reads_its_own_metadata_not_a_groups_copy(tmp_path):
    # the group's consolidated copy is older than the array (rewritten since): a level read
    # through the group takes the copy, the array named directly its own zarr.json
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    g.create_array("arr", shape=(4, 4), chunks=(2, 2), dtype="i4", fill_value=1)[...] = 0
    zarr.consolidate_metadata(str(tmp_path / "g.zarr"))
    zarr.create_array(str(tmp_path / "g.zarr" / "arr"), shape=(6, 6), chunks=(2, 2), dtype="i4", fill_value=9, overwrite=True)
    md = damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())
    with pytest.raises(damacy.InvalidArgument, match="group"):
        damacy.read(str(tmp_path / "g.zarr"), metadata=md)  # loads the group and its consolidated copy
    got = damacy.read(str(tmp_path / "g.zarr" / "arr"), metadata=md)
    np.testing.assert_array_equal(got, zarr.open_array(str(tmp_path / "g.zarr" / "arr"), mode="r")[...])
    assert got.shape == (6, 6) and (got == 9).all()


def test_a_malformed_zmetadata_is_a_metadata_error(tmp_path):
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=2)
    g.attrs["multiscales"] = [{"version": "0.4", "datasets": [{"path": "0"}]}]
    (tmp_path / "g.zarr" / ".zmetadata").write_text('{"metadata": {}}')
    with pytest.raises(damacy.MetadataError, match=r"\.zmetadata: expected zarr_consolidated_format 1"):
        damacy.open_image(str(tmp_path / "g.zarr"), metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))


def test_damacyd_refuses_a_storage_option_without_a_value(tmp_path):
    import subprocess

    from daemon_helpers import damacyd_command

    run = subprocess.run(
        [*damacyd_command(), "--endpoint", f"ipc://{tmp_path}/x.sock", "--storage-option", "s3://b", "region"],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2 and "'region' is not KEY=VALUE" in run.stderr


def test_the_cuda_executor_reads_object_stores_too(http, sharded):
    """The GPU path on the host stand-in device (the kernels' host twin): an object store's
    reads of a batch are requested together, and the batch is exact."""
    from damacy_server.cuda import twin

    if not twin.available():
        pytest.skip("the kernels' host twin was not built (no C compiler)")
    from damacy_server.cuda.device import HostDevice

    from pipeline_helpers import composed

    _, expected = sharded
    boxes = [np.s_[0:12, 0:10], np.s_[0:12, 30:40], np.s_[35:47, 2:12], np.s_[20:32, 20:30]]
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(12, 10), dtype="u16")
    executor = damacy.CudaExecutor(reader=damacy.FileReader(), limits=damacy.CudaLimits(max_gpu_memory_bytes=256 << 20), backend=HostDevice())
    out: dict = {}

    def run():
        with composed(cfg, executor=executor) as p:
            # a first batch of the same boxes: the planner's metadata and shard indexes are
            # cached, and the next batch makes chunk reads only
            p.push(damacy.Sample(f"{http.url}/a.zarr", b) for b in boxes)
            p.pop().release()
            out["before"] = len(http.statuses("/a.zarr/c/1/0"))
            http.stall.add("/a.zarr/c/0/1")
            p.push(damacy.Sample(f"{http.url}/a.zarr", b) for b in boxes)
            out["batch"] = np.array(np.from_dlpack(p.pop()))

    t = threading.Thread(target=run)
    t.start()
    try:
        assert http.stalled.wait(30)
        # while shard c/0/1 stalls, the batch's reads of the other shards were requested
        wait_for(lambda: len(http.statuses("/a.zarr/c/1/0")) > out["before"], what="the other shards' chunk requests")
    finally:
        http.release.set()
        t.join(60)
    for k, box in enumerate(boxes):
        np.testing.assert_array_equal(out["batch"][k], expected[box])


def test_an_azure_container_at_account_uri_is_not_taken_for_credentials():
    assert normalized("abfss://data@account.dfs.core.windows.net/a.zarr") == "abfss://data@account.dfs.core.windows.net/a.zarr"
    with pytest.raises(damacy.InvalidArgument, match="credentials"):
        normalized("abfss://user:secret@account.dfs.core.windows.net/a.zarr")


def test_range_options_are_ones_obstore_takes(tmp_path):
    # bounded, open-ended and suffix ranges in the forms obstore's get accepts
    import obstore
    from obstore.store import LocalStore

    from damacy_server.store.remote import _range_option

    (tmp_path / "x.bin").write_bytes(bytes(range(10)))
    store = LocalStore(str(tmp_path))
    get = lambda offset, length: bytes(obstore.get(store, "x.bin", options={"range": _range_option(offset, length)}).bytes())  # noqa: E731
    assert get(2, 3) == bytes([2, 3, 4]) and get(7, -1) == bytes([7, 8, 9]) and get(-4, 4) == bytes([6, 7, 8, 9])


@pytest.mark.parametrize(
    "uri",
    ["s3://AKIAEXAMPLE:hunter2secret@bkt/a.zarr", "https://host.example/a.zarr?X-Amz-Signature=hunter2secret", "gs://bkt/a.zarr#hunter2secret"],
)
def test_a_secret_in_a_uri_appears_in_no_error_and_no_daemon_log(uri, daemon):
    """A uri with credentials, a signature or a fragment is refused; neither the error (its
    uri, its sample) nor damacyd's log repeats the secret."""
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(1, 1), on_error="fill")
    for kw in ({"embedded": True}, {"endpoint": daemon.endpoint}):
        with damacy.Pipeline(cfg, **kw) as p:
            p.push([damacy.Sample(uri, np.s_[0:1, 0:1])])
            with p.pop() as b:
                ((_, e),) = b.info.errors
                assert isinstance(e, damacy.InvalidArgument) and "hunter2secret" not in str(e) and "***" in str(e)
                assert "hunter2secret" not in repr(b.info.samples[0])
    with pytest.raises(damacy.InvalidArgument) as e:
        damacy.read(uri)
    assert "hunter2secret" not in str(e.value) and "hunter2secret" not in str(e.value.uri)
    assert "hunter2secret" not in daemon.log_path.read_text()
