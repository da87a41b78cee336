"""Kafka's wire protocol on every broker: existing Kafka clients and tools work unchanged.

A topic is a stream, a partition a streamlet, the partition leader the broker owning it.
The sans-IO parts: ``framing`` (size-prefixed frames, headers), ``versions`` (the APIs and
versions served, kio's codecs), ``codes`` (kera's errors as Kafka's error codes),
``batch`` (a RecordBatch's header read, checked and re-based), ``log`` (a partition's
dense offsets over its chunks), ``convert`` (kera chunks as record batches and back, in
numpy). The serving parts: ``listener`` (connections, behind the broker's door), and a
module per family of requests: ``metadata``, ``topics``, ``produce``, ``fetch``,
``offsets``, ``groups``.
"""
