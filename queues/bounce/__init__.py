"""Bounces: building DSNs (RFC 3464) and deciding who is owed one."""
