"""Corrupt copies on a backup's disk never cost an acknowledged record.

Copies of a virtual segment are byte-identical, so recovery reads each chunk
from whichever copy holds it intact: one corrupt copy (of R-1) loses nothing.
Real processes, kill -9, bytes flipped in the segment files.
"""

from __future__ import annotations

import os
import sys

import trio

from kera.backup.segment_file import FILE_HEADER_SIZE, SUFFIX

from .damage import flip_bits, flip_middle
from .workload import consume_all, create, produce_all, send_and_flush, status

AFTER = 9  # the producer index written in the values of records sent after recovery


async def wait_recovered(coord, brokers: set[int]) -> list[dict]:
    """Until a recovery of each of ``brokers`` is done; returns those recoveries."""
    while True:
        recs = (await status(coord))["recoveries"]
        done = {r["broker"]: r for r in recs if r["state"] == "done" and r["broker"] in brokers}
        if set(done) == brokers:
            return list(done.values())
        await trio.sleep(0.1)


def flip_middle_bytes(segdir: str, prefix: str = "", names: set | None = None) -> int:
    """Flip one byte in the middle of the chunk area of every segment file named ``prefix``...
    (or in ``names``)."""
    flipped = 0
    for name in sorted(os.listdir(segdir)):
        if not name.endswith(SUFFIX) or not name.startswith(prefix) or (names is not None
                                                                          and name not in names):
            continue
        path = os.path.join(segdir, name)
        size = os.path.getsize(path)
        if size <= FILE_HEADER_SIZE + 200:
            continue  # no chunk worth the name
        flip_middle(path)
        flipped += 1
    return flipped


async def test_whole_cluster_restart_with_one_backup_corrupt_everywhere(make_cluster):
    """R=3, 3 nodes: kill -9 everything, corrupt every file of one backup, start again: all back."""
    cluster = make_cluster(3, broker_args=["--vseg-size", str(256 << 10)])
    coord = cluster.coordinator
    streams = [f"c{i:02d}" for i in range(8)]
    await create(coord, streams, replication=3, streamlets=4)
    producers, per_pair = 2, 2500  # 40,000 acknowledged records
    with trio.fail_after(150):
        await produce_all(coord, streams, producers, per_pair, 5)
        before = {b["id"] for b in (await status(coord))["brokers"]}
        cluster.kill_all()
        segdir = os.path.join(cluster.data, "node1-backup", "segments")
        assert flip_middle_bytes(segdir) >= 8
        cluster.start()  # same data dir and coordinator port
        coord = cluster.coordinator
        recs = await wait_recovered(coord, before)
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
        ledger.check({(s, p): per_pair for s in streams for p in range(producers)})
        await send_and_flush(coord, streams, AFTER, 200)  # new writes are acknowledged
        ledger = await consume_all(coord, streams, (producers * per_pair + 200) * len(streams))
    ledger.check({**{(s, p): per_pair for s in streams for p in range(producers)},
                  **{(s, AFTER): 200 for s in streams}})
    assert all(r["lost"] == [] for r in recs), recs
    assert "corrupt at offset" in cluster.log("node1-backup")  # the damage was there, and seen
    # replays route around corrupt chunks the backup indexed on load (no corrupt step needed)
    print("recoveries:", [(r["broker"], r["seconds"], r["chunks"], r["corrupt_steps"]) for r in recs])


async def test_broker_killed_while_one_backup_copy_is_corrupt(make_cluster):
    """kill -9 a broker whose copies on one backup rotted on disk after that backup loaded them."""
    cluster = make_cluster(3)
    coord = cluster.coordinator
    streams = [f"d{i:02d}" for i in range(8)]
    await create(coord, streams, replication=3, streamlets=6)
    producers, per_pair = 2, 2500
    with trio.fail_after(150):
        await produce_all(coord, streams, producers, per_pair, 5)
        st = await status(coord)
        victim = next(b for b in st["brokers"] if b["addr"] == cluster.addrs["node1-broker"])
        # the backup restarts and loads its files (intact): it now reads them from disk ...
        cluster.kill("node2-backup")
        cluster.restart("node2-backup")
        while not any(b["alive"] and b["addr"] == cluster.addrs["node2-backup"]
                      for b in (await status(coord))["backups"]):
            await trio.sleep(0.05)
        # ... and the disk rots under it: only a read finds out
        segdir = os.path.join(cluster.data, "node2-backup", "segments")
        assert flip_middle_bytes(segdir, prefix=f"{victim['id']}-") >= 1
        cluster.kill("node1-broker")
        (rec,) = await wait_recovered(coord, {victim["id"]})
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
        ledger.check({(s, p): per_pair for s in streams for p in range(producers)})
        await send_and_flush(coord, streams, AFTER, 200)
        ledger = await consume_all(coord, streams, (producers * per_pair + 200) * len(streams))
    ledger.check({**{(s, p): per_pair for s in streams for p in range(producers)},
                  **{(s, AFTER): 200 for s in streams}})
    assert rec["lost"] == [], rec
    assert rec["corrupt_steps"] >= 1, rec
    assert "failed verification" in cluster.log("node2-backup")
    print("recovery:", rec)


async def test_recovery_waits_for_a_down_backup_rather_than_truncating(make_cluster):
    """The dead broker's only intact copies are on a backup that is down, the others are
    corrupt: recovery waits for that backup instead of ending the logs, and loses nothing."""
    cluster = make_cluster(4)
    coord = cluster.coordinator
    streams = [f"e{i:02d}" for i in range(8)]
    await create(coord, streams, replication=3, streamlets=8)
    producers, per_pair = 2, 1500
    with trio.fail_after(150):
        await produce_all(coord, streams, producers, per_pair, 5)
        st = await status(coord)
        victim = next(b for b in st["brokers"] if b["addr"] == cluster.addrs["node1-broker"])
        prefix = f"{victim['id']}-"

        def segdir(node):
            return os.path.join(cluster.data, f"{node}-backup", "segments")

        files = {n: {f for f in os.listdir(segdir(n)) if f.startswith(prefix)}
                 for n in ("node1", "node2", "node3", "node4")}
        # one backup goes down with the broker; every other copy of the vsegs it holds rots
        down = max(files, key=lambda n: len(files[n]))
        rotten = {n: files[n] & files[down] for n in files if n != down and files[n] & files[down]}
        assert rotten, files  # R=3: each vseg has a second copy somewhere
        for name in [f"{down}-backup", "node1-broker"] + [f"{n}-backup" for n in rotten]:
            cluster.kill(name)
        for n, names in rotten.items():
            assert flip_middle_bytes(segdir(n), names=names) >= 1
            cluster.restart(f"{n}-backup")  # loads them: corrupt chunks indexed as such
        while not any(r["broker"] == victim["id"] and "LogIncomplete" in r["error"]
                      for r in (await status(coord))["recoveries"]):
            await trio.sleep(0.1)
        cluster.restart(f"{down}-backup")
        (rec,) = await wait_recovered(coord, {victim["id"]})
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})
    assert rec["lost"] == [], rec
    assert all("corrupt at offset" in cluster.log(f"{n}-backup") for n in rotten)
    print("recovery:", rec)


async def test_every_copy_corrupt_is_reported_exactly_and_nothing_dropped(make_cluster):
    """Beyond the fault budget (every copy of a vseg corrupt at the same chunk): the log ends
    there, the loss is reported with its exact range (log, status, ``kera status``) and
    every copy of that incarnation is kept for whoever wants to look."""
    cluster = make_cluster(3)
    coord = cluster.coordinator
    streams = [f"f{i:02d}" for i in range(4)]
    await create(coord, streams, replication=3, streamlets=6)
    producers, per_pair = 2, 2500
    total = producers * per_pair * len(streams)
    with trio.fail_after(150):
        await produce_all(coord, streams, producers, per_pair, 5)
        st = await status(coord)
        victim = next(b for b in st["brokers"] if b["addr"] == cluster.addrs["node1-broker"])
        prefix = f"{victim['id']}-"
        cluster.kill_all()
        # the first chunk of every copy of the victim's vsegs, wherever they are
        copies = []
        for n in ("node1", "node2", "node3"):
            d = os.path.join(cluster.data, f"{n}-backup", "segments")
            for name in os.listdir(d):
                if name.startswith(prefix):
                    copies.append(os.path.join(d, name))
                    flip_bits(copies[-1], FILE_HEADER_SIZE + 100, 0xFF)  # past its header
        assert copies
        cluster.start()
        coord = cluster.coordinator
        (rec,) = await wait_recovered(coord, {victim["id"]})
        ledger = await consume_all(coord, streams, total, idle=5)
        await send_and_flush(coord, streams, AFTER, 100)  # the streamlets are served again
    assert 0 < ledger.records < total
    assert rec["lost"] and all(x["vseg"] > 0 or x["offset"] == 0 for x in rec["lost"]), rec
    firsts = [x for x in rec["lost"] if x["vseg"] == 0]
    assert all(x["end"] and "no copy holds vseg 0 at offset 0 intact" in x["reason"] for x in firsts)
    assert all(os.path.exists(p) for p in copies), "copies of a log that lost data are kept"
    log = cluster.log("coordinator")
    assert all(f"LOST vlog {x['vlog']} vseg {x['vseg']} bytes {x['offset']}.." in log for x in rec["lost"])
    out = await trio.run_process([sys.executable, "-m", "kera", "status"], capture_stdout=True,
                                 env={**os.environ, "KERA_COORDINATOR": coord})
    assert f"LOST vlog {firsts[0]['vlog']} vseg 0 bytes 0..{firsts[0]['end']}" in out.stdout.decode()
