"""Traffic shaping per destination (docs/shaping.md).

``policy`` reads and matches the ``MAILRELAY_SHAPING`` file, ``limiter``
keeps the shared counters in Redis (connection slots, message and connection
rates), ``adaptive`` halves a destination's limits after a throttling reply
and brings them back step by step, ``gate`` is what a delivery round asks.
"""
