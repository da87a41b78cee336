"""A broker's metrics, read from ``BrokerService.stats()`` (what its heartbeats carry and
``kera status`` prints) when scraped.

Series per vlog are bounded by the broker's virtual logs (``--vlogs``, 4 by default; with
the per-stream or per-group policies only the ``MAX_VLOG_SERIES`` most lagging get a
series of their own, the totals cover all). Per-stream series are off unless
``--metrics-top-streams N`` asks for the N streams with the most bytes in: finding them
walks the broker's streamlets once per scrape, which a broker of 100,000 streams should
not do every second.
"""

from __future__ import annotations

from .endpoint import Metrics
from .families import Collector

MAX_VLOG_SERIES = 64


def install(svc, top_streams: int = 0) -> Metrics:
    m = Metrics("broker")
    m.time_rpcs(svc)
    m.registry.register(Collector("kera_broker_", lambda f: _fill(svc, f, top_streams)))
    svc.metrics = m
    return m


def _fill(svc, f, top_streams: int) -> None:
    s = svc.stats()
    f.gauge("up", "1 while the broker serves (0: fenced, rejoining)", 0 if svc.fenced else 1)
    f.gauge("epoch", "The broker's incarnation", svc.epoch)
    f.counter("records_in", "Records of produced chunks taken (resends included)", s["records_in"])
    f.counter("bytes_in", "Bytes of produce requests' chunks", s["bytes_in"])
    f.counter("records_out", "Records of the chunks served to pulls", s["records_out"])
    f.counter("bytes_out", "Bytes of chunks served to pulls", s["bytes_out"])
    f.counter("produce_requests", "Produce requests", s["requests"])
    f.counter("pull_requests", "Pull requests", s["pulls"])
    f.counter("appended_chunks", "Chunks appended, placed or adopted (this incarnation)", s["chunks"])
    f.counter("appended_bytes", "Bytes of those chunks", s["bytes"])
    f.gauge("streamlets", "Streamlets owned", s["streamlets"])
    f.gauge("memory_used_bytes", "Bytes of segment buffers held", s["memory"])
    f.gauge("memory_budget_bytes", "The memory budget (0: none)", s["memory_limit"])
    f.counter("evictions", "Segments evicted under the memory budget", s["evictions"])
    f.counter("evicted_bytes", "Their bytes", s["evicted_bytes"])
    f.counter("freed_segments", "Segments freed by retention or deletion", s["freed_segments"])
    f.counter("freed_bytes", "Their bytes", s["freed_bytes"])
    f.counter("tiered_reads", "Evicted segments read back from a backup", s["tiered_reads"])
    f.counter("tiered_read_bytes", "Their bytes", s["tiered_bytes"])
    rep = s["replication"] or {}
    f.counter("replicate_rpcs", "Replicate RPCs sent to backups", rep.get("rpcs", 0))
    f.counter("replicate_chunks", "Vseg copies carried by them (chunks per RPC: the ratio of "
              "this to replicate_rpcs)", rep.get("entries", 0))
    f.counter("replicate_bytes", "Bytes carried by them", rep.get("bytes", 0))
    rb = s["rebuild"] or {}
    f.counter("rebuilt_vsegs", "Lost copies of frozen vsegs made again", rb.get("rebuilt", 0))
    f.counter("rebuilt_bytes", "Their bytes", rb.get("rebuilt_bytes", 0))
    f.gauge("frozen_under_replicated_vsegs", "Frozen vsegs short of copies after the last "
            "rebuild pass", rb.get("under_replicated", 0))
    f.gauge("without_copy_vsegs", "Frozen vsegs with no whole copy on a live backup",
            rb.get("without_copy", 0))
    f.counter("stray_copies_found", "Whole copies of frozen vsegs the vlog had given up on, "
              "taken as sources once no known copy was left", rb.get("strays", 0))
    f.counter("recoveries_served", "Assignments of a dead broker's streamlets rebuilt here",
              s["recoveries_served"])
    vlogs = s["vlogs"]
    f.gauge("under_replicated_vsegs", "Vsegs held on fewer live backups than their replication "
            "(Kafka's UnderReplicatedPartitions)",
            sum(v["vsegs"] - v["fully_replicated"] for v in vlogs))
    f.gauge("vsegs", "Vsegs held (not released)", sum(v["vsegs"] for v in vlogs))
    f.gauge("vlogs", "Virtual logs", len(vlogs))
    shown = sorted(vlogs, key=lambda v: -v["lag"])[:MAX_VLOG_SERIES]
    f.gauge("vlog_durable_lag_chunks", "Chunks appended to a vlog not yet durable on its copies",
            labels=["vlog"], samples=[((v["vlog"],), v["lag"]) for v in shown])
    f.gauge("durable_lag_chunks", "The same over every vlog", sum(v["lag"] for v in vlogs))
    f.counter("vlog_give_ups", "Backups a vlog gave up on (replaced)", sum(v["give_ups"] for v in vlogs))
    if top_streams > 0:
        f.counter("stream_bytes_in", f"Bytes appended per stream, the {top_streams} streams with "
                  "the most", labels=["stream"], samples=_top_streams(svc, top_streams))


def _top_streams(svc, n: int) -> list:
    per: dict[int, int] = {}
    for (sid, _), sl in svc.streamlets.items():
        per[sid] = per.get(sid, 0) + sl.appended_bytes
    top = sorted(per.items(), key=lambda kv: -kv[1])[:n]
    return [((svc.streams[sid].name if sid in svc.streams else sid,), v) for sid, v in top]
