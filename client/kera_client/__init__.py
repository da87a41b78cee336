"""Python client for kera: producers, consumers, admin, and the Spark data source."""

from .admin import Admin, AsyncAdmin, open_admin
from .consumer import AsyncConsumer, Chunk, Consumer, Record, open_consumer
from .delivery import BatchReport, DeliveryReport, Pending
from .kv import AsyncKVMap, KVMap, open_kv
from .producer import AsyncProducer, ProduceError, Producer, open_producer

__all__ = [
    "Admin", "AsyncAdmin", "AsyncConsumer", "AsyncKVMap", "AsyncProducer", "BatchReport", "Chunk", "Consumer",
    "DeliveryReport", "KVMap", "Pending", "ProduceError", "Producer", "Record", "open_admin", "open_consumer", "open_kv", "open_producer",
]
