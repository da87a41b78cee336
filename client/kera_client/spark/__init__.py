"""``kera`` as a PySpark (4.x) Python data source.

Register it once per session, then use ``format("kera")``::

    from kera_client.spark import KeraDataSource
    spark.dataSource.register(KeraDataSource)

    df = (spark.readStream.format("kera").option("coordinator", "127.0.0.1:7700")
          .option("pattern", "sensor-*").load())

See docs/spark.md for the options, the schema and the offsets format.
"""

import re

import pyspark

_v = tuple(int(x) for x in re.findall(r"\d+", pyspark.__version__)[:2])
if _v < (4, 2):
    raise ImportError(f"kera_client.spark needs PySpark >= 4.2 (the Python data source API with "
                      f"latestOffset(start, limit) admission control); this is PySpark {pyspark.__version__}")

from .arrow import ARROW_SCHEMA, SCHEMA  # noqa: E402
from .positions import Offsets  # noqa: E402
from .source import KeraDataSource  # noqa: E402


def register(spark) -> None:
    """Same as ``spark.dataSource.register(KeraDataSource)``."""
    spark.dataSource.register(KeraDataSource)


__all__ = ["ARROW_SCHEMA", "KeraDataSource", "Offsets", "SCHEMA", "register"]
