"""The store reads only what a request needs; metadata and shard indexes are cached."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_server import native
from damacy_server.cache import LRUCache
from damacy_server.plan.resolve import Caches, Resolver
from damacy_server.store import FileStore

from conftest import random_data, write_array

LE = BytesCodec(endian="little")


class CountingStore(FileStore):
    """A file store that records every read."""

    def __init__(self):
        super().__init__()
        self.whole: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def read(self, key):
        with self._lock:
            self.whole.append(key)
        return super().read(key)

    def read_ranges(self, key, ranges):
        with self._lock:
            self.ranges.extend((key, o, n) for o, n in ranges)
        return super().read_ranges(key, ranges)

    def read_range_sized(self, key, offset, length):
        with self._lock:
            self.ranges.append((key, offset, length))
        return super().read_range_sized(key, offset, length)


def test_shards_are_read_by_range_and_indexes_once(tmp_path):
    data = random_data((16, 16), "uint16", seed=1)
    serializer = ShardingCodec(chunk_shape=(4, 4), codecs=[LE, ZstdCodec(level=1)], index_codecs=[LE, Crc32cCodec()])
    write_array(tmp_path / "s", data, chunks=(16, 16), serializer=serializer)
    store = CountingStore()
    md = Resolver(store, Caches(damacy.MetadataCache(array_entries=4, shard_index_entries=16)))  # metadata with its caches

    got = damacy.read(tmp_path / "s", np.s_[0:4, 4:8], metadata=md)
    assert np.array_equal(got, data[0:4, 4:8])
    shard = str(tmp_path / "s" / "c" / "0" / "0")
    assert store.whole == [str(tmp_path / "s" / "zarr.json")]  # never the whole shard
    index_reads = [r for r in store.ranges if r[1] < 0]
    chunk_reads = [r for r in store.ranges if r[1] >= 0]
    assert index_reads == [(shard, -(16 * 16 + 4), 16 * 16 + 4)]  # 16 entries of 16 bytes + crc
    assert len(chunk_reads) == 1 and chunk_reads[0][0] == shard

    damacy.read(tmp_path / "s", np.s_[8:16, 0:4], metadata=md)
    assert len([r for r in store.ranges if r[1] < 0]) == 1  # the index came from the cache
    stats = md.cache.stats()
    assert stats["arrays"]["misses"] == 1 and stats["arrays"]["hits"] >= 1  # zarr.json parsed once
    assert stats["shard_indexes"]["hits"] >= 1 and stats["shard_indexes"]["misses"] == 1


def test_shard_indexes_are_bounded_by_bytes_and_reported(tmp_path):
    # 4 shards of 64 chunks: an index of 64 x 16 bytes each; 3 fit in the bound
    data = random_data((32, 32), "uint16", seed=2)
    serializer = ShardingCodec(chunk_shape=(2, 2), codecs=[LE], index_codecs=[LE, Crc32cCodec()])
    write_array(tmp_path / "s", data, chunks=(16, 16), serializer=serializer)
    bound = 3 * (64 * 16 + 64) + 10
    md = Resolver(CountingStore(), Caches(damacy.MetadataCache(shard_index_entries=100, shard_index_bytes=bound)))
    got = damacy.read(tmp_path / "s", np.s_[:, :], metadata=md)
    assert np.array_equal(got, data)
    stats = md.cache.stats()["shard_indexes"]
    assert stats["entries"] == 3 and stats["bytes"] == 3 * (64 * 16 + 64) <= bound and stats["evictions"] == 1
    with pytest.raises(ValueError, match="shard_index_bytes"):
        damacy.MetadataCache(shard_index_bytes=-1)


def test_lru_bounds_and_counters():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1
    c.put("c", 3)  # evicts b, the least recently used
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3
    assert c.stats() == {
        "entries": 2, "bytes": 0, "hits": 3, "misses": 1, "evictions": 1, "rejections": 0, "admission": "lru", "switches": 0,
    }

    b = LRUCache(max_bytes=10, sizeof=len)
    b.put("x", b"123456")
    b.put("y", b"12345")
    assert b.get("x") is None and len(b) == 1 and b.nbytes == 5
    b.put("big", b"x" * 11)  # larger than the whole budget: not kept
    assert b.get("big") is None and b.get("y") == b"12345"

    off = LRUCache(0)
    off.put("a", 1)
    assert off.get("a") is None and len(off) == 0


def _epochs(cache, keys: int, epochs: int, seed: int = 0) -> int:
    """Re-read ``keys`` keys in a new order each epoch, as training does; returns the hits."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for k in rng.permutation(keys).tolist():
            if cache.get(k) is None:
                cache.put(k, k)
    return cache.hits


def test_frequency_admission_keeps_part_of_the_data_across_epochs():
    # 100 entries for 200 keys, 5 epochs: LRU evicts most entries before their next use; the
    # adaptive cache sees its shadow (playing the frequency rule) hit more, takes that rule
    # and keeps a stable half, hit about once every two reads from then on
    lru = _epochs(LRUCache(100), 200, 5)
    adaptive = LRUCache(100, admit_by_frequency=True)
    tiny = _epochs(adaptive, 200, 5)
    assert adaptive.admission == "frequency" and adaptive.stats()["switches"] == 1
    assert tiny >= 0.3 * 4 * 200 and tiny > 2 * lru
    # the rule itself: a key asked for clearly more often than the entry it would evict
    # displaces it; so does a new working set
    c = LRUCache(4, admit_by_frequency=True)
    c._by_frequency = True  # the rule in force from the start
    for k in "abcd":
        c.get(k)
        assert c.put(k, k)
    c.get("e")
    assert not c.would_admit("e", 0) and not c.put("e", "e") and c.stats()["rejections"] == 1
    c.get("e")
    assert not c.would_admit("e", 0)  # once more than "a" is not enough
    c.get("e")
    assert c.would_admit("e", 0) and c.put("e", "e") and c.get("a") is None and c.get("e") == "e"
    for _ in range(8):  # "e" was read 4 times: "z" needs 6 reads to displace it
        for k in "wxyz":
            if c.get(k) is None:
                c.put(k, k)
    assert set(c._data) == set("wxyz")


def _volumes(cache, volumes: int, keys: int, reads: int) -> list[int]:
    """Volumes read one after another, each ``reads`` times over in a new order (a moving
    working set, as chunk-aware epochs read their windows); the hits of each volume."""
    hits = []
    for vol in range(volumes):
        before = cache.hits
        for r in range(reads):
            for k in np.random.default_rng([vol, r]).permutation(keys).tolist():
                if cache.get((vol, k)) is None:
                    cache.put((vol, k), k)
        hits.append(cache.hits - before)
    return hits


def test_a_moving_working_set_is_admitted():
    # each volume fits (80 keys in 100 entries): after its first read, every read hits, for
    # LRU and for the adaptive cache alike, in whichever rule it took before
    best = (4 - 1) * 80
    assert _volumes(LRUCache(100), 6, 80, 4) == [best] * 6
    fresh = LRUCache(100, admit_by_frequency=True)
    assert _volumes(fresh, 6, 80, 4) == [best] * 6 and fresh.admission == "recency"
    # after epochs that made it admit by frequency, the old counts turn the new volumes
    # away; the shadow (plain LRU) hits more within a period and the cache switches back
    trained = LRUCache(100, admit_by_frequency=True)
    _epochs(trained, 200, 5)
    assert trained.admission == "frequency"
    hits = _volumes(trained, 6, 80, 4)
    assert trained.admission == "recency" and trained.stats()["switches"] == 2
    assert sum(hits[1:]) >= 0.9 * 5 * best, hits


def test_a_switch_of_rules_keeps_the_recency_order_of_the_entries_it_puts_first():
    cache = LRUCache(4, admit_by_frequency=True)
    for k in "abcd":
        cache.put(k, k)
    for k in "abcd" * 3:  # a to d asked for often
        cache.get(k)
    cache.put("e", "e")
    cache.put("f", "f")  # recency admits e and f in place of a and b; the shadow (by frequency) keeps a to d
    cache.get("e")  # f is now the least recently used of them
    while cache.stats()["switches"] == 0:  # the shadow hits a to d, the cache only c and d
        cache.get_many(list("abcd"))
    assert cache.admission == "frequency"
    cache.put("a", "a")  # asked for often: admitted in place of the least recently used
    assert cache.peek("e") == "e" and cache.peek("f") is None


def test_peeks_of_many_keys_count_nothing_and_keep_the_order():
    cache = LRUCache(3)
    for k in "abc":
        cache.put(k, k.upper())
    assert cache.peek_many(["c", "x", "a"]) == ["C", None, "A"] and cache.peek_many(["x", "y"]) == [None, None]
    assert cache.stats()["hits"] == cache.stats()["misses"] == 0  # peeks are no lookups
    cache.put("d", "D")  # "a" is still the least recently used: peeks moved nothing
    assert cache.peek("a") is None and cache.peek_many(list("bcd")) == list("BCD")


def test_file_store_ranges(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(bytes(range(100)))
    s = FileStore()
    assert s.read_ranges(str(f), [(0, 3), (-2, 2), (98, 10)]) == [b"\x00\x01\x02", b"\x62\x63", b"\x62\x63"]
    assert s.size(str(f)) == 100 and s.exists(str(f))
    assert s.read(str(tmp_path / "missing")) is None and s.read_range(str(tmp_path / "missing"), 0, 1) is None
    assert s.size(str(tmp_path / "missing")) is None


class InFlight(damacy.FileMetadataReader):
    """A metadata reader that counts its reads in flight. After :meth:`together`, the next
    ``k`` reads wait for each other (so they must run at once, or the barrier breaks)."""

    def __init__(self, concurrency: int) -> None:
        super().__init__(concurrency=concurrency)
        self._lock = threading.Lock()
        self.now = self.peak = self.calls = 0
        self._barrier: threading.Barrier | None = None
        self._first = 0

    def together(self, k: int) -> None:
        self.peak = 0
        self._barrier = threading.Barrier(k, timeout=60) if k > 1 else None
        self._first = self.calls

    def _counted(self, read, *args):
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.calls += 1
            wait = self._barrier is not None and self.calls - self._first <= self._barrier.parties
        try:
            if wait:
                self._barrier.wait()
            return read(*args)
        finally:
            with self._lock:
                self.now -= 1

    def read(self, key):
        return self._counted(super().read, key)

    def read_range_sized(self, key, offset, length):
        return self._counted(super().read_range_sized, key, offset, length)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_metadata_reader_concurrency_is_the_planners_reads_in_flight(tmp_path, concurrency):
    """FileMetadataReader(concurrency=k): the zarr.json files of a batch's arrays, then the
    outer shard indexes of its samples, are read k at a time (one after another for 1)."""
    serializer = ShardingCodec(chunk_shape=(4, 8, 8), codecs=[LE, ZstdCodec(level=1)], index_codecs=[LE, Crc32cCodec()])
    arrays = []
    for k in range(8):
        data = random_data((8, 32, 64), "uint16", seed=k)
        write_array(tmp_path / f"a{k}", data, chunks=(8, 16, 16), serializer=serializer)
        arrays.append((str(tmp_path / f"a{k}"), data))

    def pipeline(reader, n):
        return damacy.Pipeline(
            planner=damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=reader, cache=damacy.MetadataCache()), limits=damacy.PlanLimits()),
            executor=damacy.CpuExecutor(reader=damacy.FileReader(workers=2), limits=damacy.CpuLimits(max_memory_bytes=2 << 30, decode_workers=2)),
            output=damacy.BatchSpec(samples=n, shape=(8, 32, 64), dtype="u16"),
            queues=damacy.QueueLimits(lookahead_samples=n, prepared_batches=1),
        )

    # eight arrays in one batch: eight zarr.json reads (each sample's 8 shard indexes are
    # then one array's own, read together too)
    reader = InFlight(concurrency)
    reader.together(concurrency)
    with pipeline(reader, 8) as pipe:
        pipe.push(damacy.Sample(uri=uri, aabb=[(0, 8), (0, 32), (0, 64)]) for uri, _ in arrays)
        with pipe.pop() as batch:
            x = np.from_dlpack(batch)
            for j, (_, data) in enumerate(arrays):
                assert np.array_equal(x[j], data)
    assert reader.peak == concurrency
    assert reader.calls == 8 + 8 * 8  # each zarr.json and each shard index once

    # one array, one sample cutting 8 shards: their indexes are read k at a time
    reader = InFlight(concurrency)
    md = Resolver(reader, Caches(damacy.MetadataCache()))  # metadata with its caches
    md.array(arrays[0][0])
    assert reader.calls == 1
    reader.together(concurrency)
    got = damacy.read(arrays[0][0], np.s_[:, :, :], metadata=md)
    assert np.array_equal(got, arrays[0][1]) and reader.calls == 1 + 8
    assert reader.peak == concurrency


def test_get_many_is_get_of_each_key():
    one, many, hits = (LRUCache(3, admit_by_frequency=True) for _ in range(3))
    for c in (one, many, hits):
        for k in "abc":
            c.put(k, k.upper())
    keys = ["a", "x", "c", "a", "y"]
    assert many.get_many(keys) == [one.get(k) for k in keys] == ["A", None, "C", "A", None]
    mask, values, addresses = hits.get_hits(keys)  # the planner's form: which keys hit, and their values
    assert mask.tolist() == [True, False, True, True, False] and values == ["A", "C", "A"] and addresses is None
    for c in (many, hits):
        assert c.stats() == one.stats() and list(c._data) == list(one._data) and c._freq == one._freq
    mask, values, _ = hits.get_hits([])
    assert mask.shape == (0,) and values == []


class _KeyByKey(LRUCache):
    """The lookup counting written key by key: the model the cache's runs must equal."""

    def _count(self, keys, hit):
        from damacy_server.cache import Counter

        span = max(len(self._data), 64)
        seen, hits, shadow_hits = self._period
        for i, key in enumerate(keys):
            self._freq[key] += 1
            self._lookups += 1
            if self._lookups >= 10 * span:
                self._lookups = 0
                self._freq = Counter({k: c >> 1 for k, c in self._freq.items() if c > 1})
            seen += 1
            hits += hit is None or bool(hit[i])  # (None: every key hit)
            if key in self._shadow:
                shadow_hits += 1
                self._shadow.move_to_end(key)
            if seen >= span:  # the period's verdict is the cache's own
                self._end_period(hits, shadow_hits)
                seen = hits = shadow_hits = 0
        self._period = [seen, hits, shadow_hits]


def test_lookups_are_counted_as_key_by_key_across_periods_ageing_and_switches():
    # a batch's lookups are counted in runs that end where a key-by-key pass would end a
    # period, age the counts or switch rules: after any trace the state is the model's
    import random

    rnd = random.Random(7)
    switches = 0
    for trial in range(40):
        size = (8, 100)[trial % 2]  # past 64 entries a period follows the size, ageing apart
        model, cache = _KeyByKey(size, admit_by_frequency=True), LRUCache(size, admit_by_frequency=True)
        base = 0
        for _ in range(120):
            if rnd.random() < 0.05:
                base += 3 * size  # the working set moves
            keys = [base + rnd.randrange(4 * size) for _ in range(rnd.randrange(1, 200))]
            assert cache.get_many(keys) == model.get_many(keys)
            for k in keys[:5]:
                assert cache.put(k, k) == model.put(k, k)
        assert cache.stats() == model.stats() and list(cache._data) == list(model._data)
        assert cache._freq == model._freq and list(cache._shadow) == list(model._shadow) and cache._period == model._period
        switches += cache.switches
    assert switches  # the traces do switch rules


def test_taking_the_frequency_rule_needs_longer_evidence_than_leaving_it():
    # the shadow playing the frequency rule must hit clearly more for 4 periods in a row (a
    # windowed epoch's turn lets it win a period or two, then lose); playing recency, 2 do
    from collections import OrderedDict

    c = LRUCache(64, admit_by_frequency=True)
    for k in range(64):
        c.put(("real", k), k)

    def shadow_wins_a_period():  # 64 lookups (a period) the shadow hits and the cache misses
        c._shadow = OrderedDict((("shadow", k), 0) for k in range(64))
        c.get_many([("shadow", k) for k in range(64)])

    for _ in range(3):
        shadow_wins_a_period()
    assert c.admission == "recency" and c.switches == 0
    c.get_many([("real", k) for k in range(64)])  # a period the cache wins: the count starts over
    for _ in range(3):
        shadow_wins_a_period()
    assert c.admission == "recency"
    shadow_wins_a_period()
    assert c.admission == "frequency" and c.switches == 1
    shadow_wins_a_period()
    assert c.admission == "frequency"
    shadow_wins_a_period()
    assert c.admission == "recency" and c.switches == 2


def _every_third(key) -> bool:
    """A third of the keys, the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(key).encode()) % 3 == 0


def _state(c) -> tuple:
    """Everything an LRUCache or an IndexedCache decides by: figures, order, counts, shadow."""
    if isinstance(c, LRUCache):
        seen, hits, shadow_hits = c._period
        order = (list(c._data), dict(c._freq or {}), list(c._shadow.items()))
        return (c.stats(), *order, c._lookups, seen, hits, shadow_hits, c._wins, c.nbytes, len(c))
    st, index = c._index.state(), c._index
    order = (index.keys(), index.counts(), index.shadow())
    period = (st["lookups"], st["seen"], st["period_hits"], st["shadow_hits"], st["wins"])
    return (c.stats(), *order, *period, c.nbytes, len(c))


@pytest.mark.skipif(not native.available(), reason="the native module is not built")
@pytest.mark.parametrize("bound", ["entries", "bytes"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_the_native_index_keeps_the_cache_rule_for_rule(bound, adaptive):
    # random traces of every operation (epochs re-read in new orders, working sets that
    # move, keys of three kinds, values of random sizes, clears and discards): after each
    # operation the native index answers and holds exactly what LRUCache does (order,
    # counts, shadow, period, figures); the traces evict, refuse and switch rules
    import random

    from damacy_server.cache import INDEX_RULES, IndexedCache

    rnd = random.Random(11 + adaptive)
    switches = evictions = rejections = 0
    for trial in range(24):
        size = (6, 40, 90)[trial % 3]
        entries, nbytes = (size, None) if bound == "entries" else (None, 10 * size)
        sizeof = len if bound == "bytes" else None
        ref = LRUCache(entries, max_bytes=nbytes, sizeof=sizeof, admit_by_frequency=adaptive)
        index = native.cache_index(entries, nbytes, adaptive, INDEX_RULES)
        nat = IndexedCache(index, sizeof=sizeof)
        assert (nat.max_entries, nat.max_bytes) == (ref.max_entries, ref.max_bytes)
        kind = trial % 3  # ints (the planner's), tuples (arrays past 2**40 units), strings
        name = (lambda k: k) if kind == 0 else (lambda k: (k // 7, k % 7)) if kind == 1 else str
        base, epoch = 0, []
        for step in range(400):
            if rnd.random() < 0.04:
                base += 2 * size  # the working set moves
            if not epoch:
                epoch = rnd.sample(range(base, base + 3 * size), 3 * size)
            keys = [name(epoch.pop()) for _ in range(min(len(epoch), rnd.randrange(1, 40)))]
            keys += [name(base + rnd.randrange(3 * size)) for _ in range(rnd.randrange(3))]  # repeats
            # int keys also as the planner gives them, an int64 key array (the index holds
            # ints as numbers: the two forms name the same entries)
            many = np.asarray(keys, dtype=np.int64) if kind == 0 and step % 2 else keys
            op = rnd.random()
            if op < 0.45:
                assert nat.get_many(keys) == ref.get_many(keys)
                for k in keys:
                    if ref.peek(k) is None:
                        value = "v" * rnd.randrange(1, 25)
                        assert nat.would_admit(k, len(value)) == ref.would_admit(k, len(value))
                        assert nat.put(k, value) == ref.put(k, value)
            elif op < 0.75:
                (m1, v1, _), (m2, v2, _) = nat.get_hits(many), ref.get_hits(many)
                assert m1.tolist() == m2.tolist() and v1 == v2
                for k in keys[:3]:
                    value = "w" * rnd.randrange(1, 12)
                    assert nat.put(k, value) == ref.put(k, value)
            elif op < 0.85:
                assert nat.peek_many(many) == ref.peek_many(many) and nat.peek(keys[0]) == ref.peek(keys[0])
                assert nat.get(keys[0]) == ref.get(keys[0])
                room = rnd.randrange(30)
                assert nat.has_room(room) == ref.has_room(room)
            elif op < 0.93:
                for k in keys[:4]:
                    value = "x" * rnd.randrange(0, 40)  # some over the byte bound
                    assert nat.put(k, value) == ref.put(k, value)
            elif op < 0.99:  # the executor's forms: a batch's units of one size offered, then kept
                size = rnd.randrange(1, 30)
                assert nat.would_admit_many(many, size) == ref.would_admit_many(many, size)
                values = ["y" * size] * len(keys)
                assert nat.put_many(many, values, size) == ref.put_many(many, values, size)
                assert nat.put_many(keys[:2], values[:2]) == ref.put_many(keys[:2], values[:2])
            elif rnd.random() < 0.5:
                nat.clear()
                ref.clear()
            else:
                assert nat.discard_where(_every_third) == ref.discard_where(_every_third)
            assert _state(nat) == _state(ref), (trial, step)
            assert nat.admission == ref.admission and nat.items() == ref.items()
        switches += ref.switches
        evictions += ref.evictions
        rejections += ref.rejections
        assert nat.hits == ref.hits and nat.switches == ref.switches
    assert evictions and (switches and rejections if adaptive else not switches)


@pytest.mark.skipif(not native.available(), reason="the native module is not built")
def test_the_native_index_hands_back_the_address_each_value_was_kept_at():
    from damacy_server.cache import INDEX_RULES, IndexedCache

    c = IndexedCache(native.cache_index(None, 100, True, INDEX_RULES), sizeof=len)
    keys = np.arange(10, 16, dtype=np.int64)
    assert c.put_many(keys[:4], ["a", "b", "c", "d"], 1, np.array([101, 102, 103, 104], dtype=np.int64)) == 4
    assert c.put_many(keys[4:], ["e", "f"], 1) == 2  # without addresses: 0
    c.put(11, "B")  # put again without one: the new value's address is unknown
    mask, values, addresses = c.get_hits(np.array([15, 99, 10, 11, 13], dtype=np.int64))
    assert mask.tolist() == [True, False, True, True, True] and values == ["f", "a", "B", "d"]
    assert addresses.tolist() == [0, 101, 0, 104]
    # Python ints, numpy ints and the key array's int64s name the same entries
    assert c.peek_many([10, np.int64(12), np.uint8(13)]) == ["a", "c", "d"] and c.get(np.int32(14)) == "e"
    with pytest.raises(TypeError, match="int64"):
        c.get_hits(np.array([10.0]))
    with pytest.raises(ValueError, match="an address"):
        c.put_many(keys[:2], ["x", "y"], 1, np.zeros(3, dtype=np.int64))


def test_a_uri_resolves_the_same_when_remembered_and_a_relative_one_follows_the_working_directory(tmp_path, monkeypatch):
    from damacy_server.store import _ROOTS, resolve_uri

    absolute = f"{tmp_path}/a/../b.zarr/"
    first = resolve_uri(absolute)
    assert first[1] == str(tmp_path / "b.zarr") and _ROOTS[absolute] == first[1]
    assert resolve_uri(absolute) == first and resolve_uri(f"file://{tmp_path}/b.zarr")[1] == first[1]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    assert resolve_uri("v.zarr")[1] == str(tmp_path / "one" / "v.zarr") and "v.zarr" not in _ROOTS
    monkeypatch.chdir(tmp_path / "two")
    assert resolve_uri("v.zarr")[1] == str(tmp_path / "two" / "v.zarr")
    with pytest.raises(damacy.InvalidArgument, match="NUL"):
        resolve_uri(f"{tmp_path}/x\0")
