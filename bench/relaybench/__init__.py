"""Helpers of bench/relay_throughput: sink, load client, Postfix reference, mailrelay, monitor."""
