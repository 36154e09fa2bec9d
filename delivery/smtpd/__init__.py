"""Inbound SMTP: accept mail over SMTP into the queue store (``message_accept``).

``session`` speaks the protocol (``InboundSMTP``, behind its aiosmtpd adapter
``AiosmtpdSession``, the one place that touches aiosmtpd's private members,
which ``aiosmtpd_members`` lists) and reads and checks DATA, with
``commands``' HELO/EHLO, MAIL and RCPT and ``auth``'s AUTH; ``policy`` parses
and judges (pure) and names every reply; ``server`` runs the listeners, the
database threads, the group commit and the categorizer doorbell; ``manage.py
runsmtp`` starts it.
"""
