"""Routing: where a recipient's mail goes next (transport map, smart host, DNS)."""
