"""Icechunk repositories (written by zarr-python through icechunk's store) read by damacy by
branch, tag and snapshot, locally and on the S3 API server, exactly as zarr-python reads the
same snapshot; the snapshot of a run stays pinned while others commit."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data

icechunk = pytest.importorskip("icechunk")


def _write(store, path, data, **kw):
    arr = zarr.create_array(store, name=path, shape=data.shape, dtype=data.dtype, **kw)
    arr[...] = data
    return arr


@pytest.fixture
def repo(tmp_path):
    """A local repository: a sharded zstd volume and a plain array on main, tagged v1."""
    repository = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    session = repository.writable_session("main")
    vol = random_data((40, 48, 36), "uint16", seed=1)
    _write(session.store, "volumes/brain", vol, chunks=(8, 12, 9), shards=(16, 24, 18), compressors=[ZstdCodec()], fill_value=3)
    _write(session.store, "plain", np.arange(100, dtype="float32").reshape(10, 10), chunks=(4, 4))
    first = session.commit("first")
    repository.create_tag("v1", first)
    return tmp_path / "repo", repository, first


def _zarr(repository, path, **version):
    return zarr.open_array(repository.readonly_session(**version).store, path=path, mode="r")[...]


def test_branches_tags_and_snapshots_read_as_zarr_reads_them(repo):
    root, repository, first = repo
    want = _zarr(repository, "volumes/brain", branch="main")
    base = f"icechunk+file://{root}"
    for version in ("?branch=main", "?tag=v1", f"?snapshot={first}", ""):  # no version: main
        np.testing.assert_array_equal(damacy.read(f"{base}{version}#/volumes/brain"), want)
    np.testing.assert_array_equal(damacy.read(f"{base}?tag=v1#plain", np.s_[2:7, 3:9]), _zarr(repository, "plain", tag="v1")[2:7, 3:9])
    # samples and index queries in a pipeline, boxes reaching out of the array padded
    uri = f"{base}?branch=main#/volumes/brain"
    boxes = [np.s_[z : z + 8, 5:29, 0:12] for z in range(0, 40, 6)]
    cfg = damacy.Config(samples_per_batch=3, sample_shape=(8, 24, 12), dtype="u16", out_of_bounds="pad", drop_last=False)
    with damacy.Pipeline(cfg) as pipe:
        pipe.push([damacy.Sample(uri, b) for b in boxes] + [damacy.IndexQuery(uri, (np.s_[0:8], [1, 40, 7] * 8, list(range(0, 36, 3))))])
        got = np.concatenate([np.array(np.from_dlpack(b)) for b in pipe])
    for b, x in zip(boxes, got):
        region = want[b]
        np.testing.assert_array_equal(x[: len(region)], region)
        assert (x[len(region) :] == 3).all()  # past the end: padded with the fill value
    np.testing.assert_array_equal(got[len(boxes)], want[0:8][:, [1, 40, 7] * 8][:, :, list(range(0, 36, 3))])


def test_the_snapshot_of_a_run_stays_while_others_commit(repo):
    root, repository, first = repo
    uri = f"icechunk+file://{root}?branch=main#/plain"
    before = damacy.read(uri)
    session = repository.writable_session("main")
    zarr.open_array(session.store, path="plain", mode="r+")[...] = -1
    second = session.commit("overwrite")
    np.testing.assert_array_equal(damacy.read(uri), before)  # main as this process first read it
    np.testing.assert_array_equal(damacy.read(f"icechunk+file://{root}?snapshot={second}#/plain"), np.full((10, 10), -1, dtype="float32"))


READ_THROUGH_TIER = """
import json, sys, time
import numpy as np
import damacy

uri, tier = sys.argv[1], sys.argv[2]
cfg = damacy.Config(samples_per_batch=1, sample_shape=(10, 10), dtype="f32", chunk_cache_dir=tier, chunk_cache_dir_bytes=1 << 24)
with damacy.Pipeline(cfg) as pipe:
    pipe.push([damacy.Sample(uri, np.s_[0:10, 0:10])])
    got = np.concatenate([np.array(np.from_dlpack(b)) for b in pipe.batches(1)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # fetched ranges are written to the tier off the fetcher
        disk = pipe.stats_dict()["disk_cache"]
        if disk["hits"] + disk["writes"] >= 9:  # the 9 chunks of the 10 x 10 array, chunks 4 x 4
            break
        time.sleep(0.05)
    print(json.dumps({"values": sorted(set(got.ravel().tolist())), "hits": disk["hits"], "writes": disk["writes"]}))
"""


def test_a_disk_tier_never_serves_a_branch_the_commit_before(repo, tmp_path):
    # the tier outlives the process: a new process resolves main to the new commit, and the
    # entries of the old one (kept under their snapshot) are not its
    import json
    import subprocess
    import sys

    root, repository, _ = repo
    uri, tier = f"icechunk+file://{root}?branch=main#/plain", str(tmp_path / "tier")

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", READ_THROUGH_TIER, uri, tier], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    assert first["values"] == list(range(100)) and first["writes"] == 9
    session = repository.writable_session("main")
    zarr.open_array(session.store, path="plain", mode="r+")[...] = -1
    session.commit("overwrite")
    second = run()
    assert second == {"values": [-1.0], "hits": 0, "writes": 9}
    assert run() == {"values": [-1.0], "hits": 9, "writes": 0}  # the new commit's entries serve


def test_wrong_versions_and_repositories_are_named(repo, tmp_path):
    root, _, _ = repo
    with pytest.raises(damacy.NotFound, match="no branch 'nope'"):
        damacy.read(f"icechunk+file://{root}?branch=nope#/plain")
    with pytest.raises(damacy.NotFound, match="no snapshot '0000000000000000000A'"):
        damacy.read(f"icechunk+file://{root}?snapshot=0000000000000000000A#/plain")
    with pytest.raises(damacy.NotFound, match="no tag 'v9'"):
        damacy.read(f"icechunk+file://{root}?tag=v9#/plain")
    with pytest.raises(damacy.NotFound, match="no icechunk repository here"):
        damacy.read(f"icechunk+file://{tmp_path / 'nothing'}?branch=main#/plain")
    with pytest.raises(damacy.NotFound, match="no Zarr array"):
        damacy.read(f"icechunk+file://{root}?branch=main#/volumes/missing")
    with pytest.raises(damacy.InvalidArgument, match="one version"):
        damacy.read(f"icechunk+file://{root}?branch=main&tag=v1#/plain")
    with pytest.raises(damacy.UnsupportedOperation, match="icechunk repositories on 'gs'"):
        damacy.read("icechunk+gs://bucket/repo#/plain")


def test_a_repository_on_the_s3_server(tmp_path, monkeypatch):
    from object_servers import S3Server

    server = S3Server()
    try:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        server.bucket("icechunk-repos")
        storage = icechunk.s3_storage(
            bucket="icechunk-repos", prefix="r1", region="us-east-1", endpoint_url=server.endpoint, allow_http=True,
            access_key_id="testing", secret_access_key="testing", force_path_style=True,
        )
        repository = icechunk.Repository.create(storage)
        session = repository.writable_session("main")
        data = random_data((30, 20), "int16", seed=4)
        _write(session.store, "a", data, chunks=(10, 10), shards=(30, 20), compressors=[ZstdCodec()])
        snap = session.commit("s3")
        np.testing.assert_array_equal(damacy.read(f"icechunk+s3://icechunk-repos/r1?snapshot={snap}#/a", np.s_[4:27, 3:19]), data[4:27, 3:19])
        np.testing.assert_array_equal(damacy.read("icechunk+s3://icechunk-repos/r1#a"), _zarr(repository, "a", branch="main"))
    finally:
        server.stop()


def test_a_daemons_roots_and_prefixes_bound_the_repositories_it_opens(repo, tmp_path_factory):
    from damacy_server.store import resolve_uri
    from damacy_server.store.remote import RemoteStores

    root, _, _ = repo
    inside = RemoteStores(allow=[], roots=[str(root.parent)])
    store, key = resolve_uri(f"icechunk+file://{root}?branch=main#/plain", inside)
    assert key.endswith("#/plain") and store.read(store.join(key, "zarr.json")) is not None
    elsewhere = RemoteStores(allow=["s3://bucket/data"], roots=[str(tmp_path_factory.mktemp("other"))])
    with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed roots and prefixes"):
        resolve_uri(f"icechunk+file://{root}?branch=main#/plain", elsewhere)
    # refused before it is opened: a client learns nothing of what lies outside (no repository
    # here, no such branch) and nothing is kept for it
    for uri in (f"icechunk+file://{root}?branch=nope#/plain", f"icechunk+file://{root.parent}/none?branch=main#/x"):
        with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed roots and prefixes"):
            resolve_uri(uri, elsewhere)
    assert not elsewhere.icechunk._stores


def _virtual_repo(tmp_path):
    """A repository whose array's two chunks are virtual: references into a raw file (after a
    99-byte header, uncompressed, back to back) in a container of the repository's config."""
    raw = tmp_path / "raw"
    raw.mkdir()
    data = random_data((8, 12, 10), "uint16", seed=9)
    blob = raw / "blob.bin"
    blob.write_bytes(b"HDR" * 33 + data[0:4].tobytes() + data[4:8].tobytes())
    config = icechunk.RepositoryConfig.default()
    container = f"file://{raw}/"
    config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(container, icechunk.local_filesystem_store(str(raw))))
    repository = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")), config=config)
    session = repository.writable_session("main")
    zarr.create_array(session.store, name="v", shape=data.shape, dtype="uint16", chunks=(4, 12, 10), compressors=None, fill_value=0)
    n = 4 * 12 * 10 * 2
    session.store.set_virtual_ref("v/c/0/0/0", f"file://{blob}", offset=99, length=n)
    session.store.set_virtual_ref("v/c/1/0/0", f"file://{blob}", offset=99 + n, length=n)
    session.commit("virtual chunks")
    return tmp_path / "repo", container, data


def test_virtual_chunks_read_as_zarr_reads_them(tmp_path):
    root, container, data = _virtual_repo(tmp_path)
    uri = f"icechunk+file://{root}?branch=main#/v"
    authorised = icechunk.Repository.open(icechunk.local_filesystem_storage(str(root)), authorize_virtual_chunk_access={container: None})
    want = zarr.open_array(authorised.readonly_session(branch="main").store, path="v", mode="r")[...]
    np.testing.assert_array_equal(want, data)
    np.testing.assert_array_equal(damacy.read(uri), want)
    np.testing.assert_array_equal(damacy.read(uri, np.s_[2:7, 1:11, 3:9], dtype="f32"), want[2:7, 1:11, 3:9].astype("f4"))


def test_a_daemon_reads_virtual_chunks_only_in_containers_it_may(tmp_path):
    import os

    from damacy_server.store import resolve_uri
    from damacy_server.store.remote import RemoteStores

    root, container, data = _virtual_repo(tmp_path)
    uri = f"icechunk+file://{root}?branch=main#/v"
    only_repo = RemoteStores(allow=[], roots=[os.path.realpath(root)])  # the repository, not the raw file's folder
    store, key = resolve_uri(uri, only_repo)
    assert store.read(store.join(key, "zarr.json")) is not None
    with pytest.raises(damacy.InvalidArgument, match=rf"virtual chunk .* is in {container}, outside the daemon's allowed roots"):
        store.read(store.join(key, "c/0/0/0"))
    both = RemoteStores(allow=[], roots=[os.path.realpath(tmp_path)])
    store, key = resolve_uri(uri, both)
    assert store.read(store.join(key, "c/1/0/0")) == data[4:8].tobytes()
