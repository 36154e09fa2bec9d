"""Inbound SMTP: accept mail over SMTP into the queue store (``message_accept``).

``policy`` parses and judges (pure), ``replies`` names every reply, and
``server`` runs aiosmtpd with them; ``manage.py runsmtp`` starts it.
"""
