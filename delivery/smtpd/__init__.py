"""Inbound SMTP: accept mail over SMTP into the queue store (``message_accept``).

``policy`` parses and judges (pure), ``replies`` names every reply, and
``server`` runs aiosmtpd with them (through ``aiosmtpd_adapter``, the one
place that touches aiosmtpd's private members; ``dbthreads`` and ``doorbell``
hold its database threads and categorizer doorbell); ``manage.py runsmtp``
starts it.
"""
