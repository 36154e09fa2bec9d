"""Back pressure: Exchange 2013's resource monitor for the SMTP ingress.

``engine`` computes levels and MAIL FROM decisions from readings (pure),
``samplers`` take the readings, ``monitor`` runs them every interval inside an
ingress process, ``store`` keeps every node's readings and events in the
database, ``api`` serves them. See README ("Back pressure").
"""
