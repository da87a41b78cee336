"""The broker: streams -> streamlets -> groups -> segments, all in memory.

``service.BrokerService`` is joined from ``pull`` (consume), ``takeover`` (recovery of a
dead broker's streamlets), ``reclaim`` (retention, release, eviction) and ``membership``.
"""
