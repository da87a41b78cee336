"""Building metric families from a server's counters at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Families:
    """The families of one scrape: ``counter``/``gauge`` add one (a value or labelled
    values); iterate to hand them to the registry."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.out = []

    def counter(self, name: str, doc: str, value=None, labels=(), samples=()):
        f = CounterMetricFamily(f"{self.prefix}{name}", doc, labels=list(labels) or None)
        self._fill(f, value, samples)

    def gauge(self, name: str, doc: str, value=None, labels=(), samples=()):
        f = GaugeMetricFamily(f"{self.prefix}{name}", doc, labels=list(labels) or None)
        self._fill(f, value, samples)

    def _fill(self, f, value, samples) -> None:
        if value is not None:
            f.add_metric([], value)
        for labels, v in samples:
            f.add_metric([str(x) for x in labels], v)
        self.out.append(f)

    def __iter__(self):
        return iter(self.out)


class Collector:
    """A registry collector calling ``fill(families)`` at each scrape."""

    def __init__(self, prefix: str, fill):
        self.prefix, self.fill = prefix, fill

    def collect(self):
        f = Families(self.prefix)
        self.fill(f)
        return iter(f)

    def describe(self):
        return []   # families are known only at collection (labels vary)
