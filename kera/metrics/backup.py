"""A backup's metrics, read from its counters and store (``rpc_stats``: what ``kera
status`` prints) when scraped; fsync rounds timed as they happen."""

from __future__ import annotations

from .endpoint import Metrics
from .families import Collector


def install(svc) -> Metrics:
    m = Metrics("backup")
    m.time_rpcs(svc)
    m.fsync = m.histogram("fsync_seconds", "Duration of an fsync round (the files it syncs at once)")
    m.registry.register(Collector("kera_backup_", lambda f: _fill(svc, f)))
    svc.metrics = m
    return m


COUNTERS = {   # counters of the backup service: metric name, help
    "replicate_rpcs": ("replicate_rpcs", "Replicate RPCs received"),
    "chunks": ("replicated_chunks", "Chunks received for replicas"),
    "bytes_received": ("bytes_received", "Bytes received for replicas"),
    "bytes_flushed": ("bytes_written", "Bytes written to segment files"),
    "fsyncs": ("fsyncs", "Files fsynced"),
    "write_errors": ("write_errors", "Failed writes or fsyncs"),
    "reads": ("reads", "Reads of replicas (recovery, rebuild)"),
    "bytes_read": ("bytes_read", "Their bytes"),
    "tiered_reads": ("tiered_reads", "Evicted segments read back for brokers"),
    "scrubbed_bytes": ("scrubbed_bytes", "Bytes read back and verified by the scrubber"),
    "verified_bytes": ("index_verified_bytes", "Bytes read back and verified before indexing a vseg "
                       "whole on fewer copies than its chunks need (recoveries)"),
    "scrub_passes": ("scrub_passes", "Scrubbing passes"),
    "damage": ("corrupt_chunks", "Corrupt chunks found on disk"),
}


def _fill(svc, f) -> None:
    c, s = svc.counters, svc.store
    for key, (name, doc) in COUNTERS.items():
        f.counter(name, doc, c.get(key, 0))
    f.gauge("replicas", "Replicas held (segment files)", len(s.replicas))
    f.gauge("disk_used_bytes", "Bytes of segment files on disk", s.committed)
    f.gauge("memory_bytes", "Bytes of replicas held in memory", s.memory)
    f.gauge("unflushed_bytes", "Bytes accepted, not yet written", s.unflushed)
    f.gauge("disk_error", "1 while the disk refuses writes", 1 if s.disk_error else 0)
    f.counter("reclaimed_bytes", "Bytes of segment files deleted once released", s.reclaimed)
