"""kera: stream storage for many small streams, after the KerA virtual-log design."""

__version__ = "0.1.0"
