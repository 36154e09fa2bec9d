"""Outbound SMTP: a round's claim, plan and send (deliver), the client, TLS, retry."""
