"""A stream's typed metadata: the maps of older versions load, unknown keys round-trip,
malformed maps are refused with a typed error, and a coordinator loads a data dir whose
log holds streams and owner and retention changes as the dict-based code wrote them."""

from __future__ import annotations

import msgpack
import pytest
import trio

from kera.coordinator.metadata import INITIAL
from kera.coordinator.metalog import MetaLog
from kera.coordinator.service import Coordinator
from kera.errors import InvalidArgument
from kera.stream_meta import StreamMeta

from .members import SECRET

# a stream as the coordinator has always written it (create_stream with defaults)
WRITTEN = {"name": "orders", "id": 7, "streamlets": 2, "groups": 1, "replication": 3,
           "segment_size": 1 << 20, "group_segments": 8, "vlogs": None, "retention_bytes": -1,
           "retention_ms": -1, "cleanup_policy": "delete", "owners": [[1, 1], [2, 1]],
           "created": 1763990000.25}
# older still: written before retention and compaction existed
OLDEST = {"name": "old", "id": 3, "streamlets": 1, "groups": 2, "replication": 1,
          "segment_size": 1 << 16, "group_segments": 4, "vlogs": "per-stream",
          "owners": [[1, 1]], "created": 1.0}


def test_a_stream_written_before_loads_and_packs_to_the_same_bytes():
    s = StreamMeta.from_wire(WRITTEN)
    assert (s.name, s.id, s.streamlets, s.owners) == ("orders", 7, 2, ((1, 1), (2, 1)))
    assert not s.compacted and s.delete_retention_ms is None and s.extra is None
    assert msgpack.packb(s.to_wire()) == msgpack.packb(WRITTEN)
    old = StreamMeta.from_wire(OLDEST)
    assert (old.retention_bytes, old.retention_ms, old.cleanup_policy) == (-1, -1, "delete")
    assert old.vlogs == "per-stream" and old.groups == 2


def test_settings_and_unknown_keys_round_trip():
    """A newer writer's keys are kept and written back: see the module's docstring."""
    d = {**WRITTEN, "cleanup_policy": "compact", "delete_retention_ms": 5, "segment_ms": 9,
         "tier": {"bucket": "b"}, "quota": 3}
    s = StreamMeta.from_wire(d)
    assert s.compacted and (s.delete_retention_ms, s.segment_ms) == (5, 9)
    assert dict(s.extra) == {"tier": {"bucket": "b"}, "quota": 3}
    assert s.to_wire() == d
    moved = s.with_owner(1, (4, 2)).altered({"retention_ms": 60_000})
    assert moved.owners == ((1, 1), (4, 2)) and moved.retention_ms == 60_000
    assert s.owners == ((1, 1), (2, 1)) and s.retention_ms == -1   # a copy: s is unchanged
    assert moved.extra == s.extra


@pytest.mark.parametrize("bad, says", [
    ([1, 2], "must be a map"),
    ({k: v for k, v in WRITTEN.items() if k != "groups"}, "lacks 'groups'"),
    ({**WRITTEN, "id": "7"}, "id must be an integer"),
    ({**WRITTEN, "streamlets": True}, "streamlets must be an integer"),
    ({**WRITTEN, "name": 5}, "name must be a string"),
    ({**WRITTEN, "owners": [[1]]}, "owners"),
    ({**WRITTEN, "owners": [["a", 1]]}, "owners"),
    ({**WRITTEN, "owners": 3}, "owners"),
    ({**WRITTEN, "retention_ms": 1.5}, "retention_ms must be an integer"),
    ({**WRITTEN, "cleanup_policy": 1}, "cleanup_policy"),
    ({**WRITTEN, "retention_bytes": None}, "retention_bytes must be an integer, not None"),
    ({**WRITTEN, "cleanup_policy": None}, "cleanup_policy must be a string, not None"),
])
def test_a_malformed_map_is_refused_naming_what_is_wrong(bad, says):
    with pytest.raises(InvalidArgument, match=says):
        StreamMeta.from_wire(bad)


async def test_a_coordinator_loads_streams_and_changes_written_as_dicts(tmp_path):
    """The metadata log as the dict-based coordinator wrote it: a whole stream, then an
    owner moved and a retention altered by key path, then a deleted stream."""
    d = str(tmp_path / "coordinator")
    log = MetaLog(d, INITIAL)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(log.run)
            log.set(("streams", "orders"), dict(WRITTEN, owners=[[1, 1], [2, 1]]))
            log.set(("streams", "old"), dict(OLDEST, owners=[[1, 1]]))
            log.set(("streams", "orders", "owners", 1), [3, 4])
            log.set(("streams", "orders", "retention_ms"), 60_000)
            log.set(("streams", "gone"), dict(OLDEST, name="gone", id=4, owners=[[1, 1]]))
            log.delete(("streams", "gone"))
            await log.commit()
            n.cancel_scope.cancel()
    log.close()
    coord = Coordinator(d, cluster_secret=SECRET)
    try:
        assert sorted(coord.metadata.streams) == ["old", "orders"]
        s = coord.metadata.streams["orders"]
        assert s.owners == ((1, 1), (3, 4)) and s.retention_ms == 60_000 and s.id == 7
        assert coord.metadata.holdings.count((3, 4)) == 1 and coord.metadata.holdings.count((1, 1)) == 2
        assert coord.metadata.streams["old"].groups == 2
        assert coord.metadata.streams.wire("orders") == {**WRITTEN, "owners": [[1, 1], [3, 4]],
                                                   "retention_ms": 60_000}
    finally:
        coord.metadata.store.close()


async def test_page_rows_say_what_the_stored_maps_say_after_every_change(tmp_path):
    """The coordinator keeps a page row per usual stream (a metadata answer of columns then
    decodes no map): after a create, an owner moved by a recovery, an alter, a delete, for a
    stream with rare settings, and once reloaded (rows made from the maps again), every page
    decodes to the streams as stored."""
    from kera import meta_columns
    from kera.coordinator.catalog import Catalog
    from kera.coordinator.metadata import PACKED

    def page(cat, names):
        got = cat.entries(names, True, None)
        live = [e for e, _ in filter(None, got)]
        cols = meta_columns.decode(meta_columns.encode_rows(
            [e[0] for e in live], [e[1] for e in live], {i: e[2] for i, e in enumerate(live) if e[2]},
            lambda b, e: f"h{b}:{e}"))
        assert [c.to_wire() for c in cols.views()] == [cat.wire(e[0]) for e in live]
        assert [m for m in cols.members if m[1] != f"h{m[0][0]}:{m[0][1]}"] == []
        return [None if e is None else e[0][0] for e in got]

    log = MetaLog(str(tmp_path / "coordinator"), INITIAL, packed=PACKED)
    names = [f"s{i}" for i in range(6)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(log.run)
            cat = Catalog(log)
            for i, name in enumerate(names):
                cat.create(StreamMeta(name=name, id=i + 1, streamlets=1 + i % 3, groups=1,
                                      replication=3, segment_size=1 << 20, group_segments=8,
                                      owners=tuple((1 + j, 1) for j in range(1 + i % 3)),
                                      created=1.5 * i, cleanup_policy="compact" if i == 5 else "delete"))
            assert page(cat, names) == names and "s5" not in cat._rows and "s0" in cat._rows
            cat.set_owner("s1", 1, (2, 1), (7, 3))
            cat.alter(cat["s2"], {"retention_ms": 60_000})
            cat.delete(cat["s3"])
            assert page(cat, [*names, "nope"]) == ["s0", "s1", "s2", None, "s4", "s5", None]
            assert cat["s1"].owners == ((1, 1), (7, 3)) and cat["s2"].retention_ms == 60_000
            await log.commit()
            n.cancel_scope.cancel()
    log.close()
    again = Catalog(MetaLog(str(tmp_path / "coordinator"), INITIAL, packed=PACKED))
    try:
        assert again._rows == {} and page(again, names) == ["s0", "s1", "s2", None, "s4", "s5"]
        assert page(again, names[:3]) == names[:3] and sorted(again._rows) == ["s0", "s1", "s2", "s4"]
    finally:
        again.store.close()
