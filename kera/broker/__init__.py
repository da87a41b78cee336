"""The broker: streams -> streamlets -> groups -> segments, all in memory."""
