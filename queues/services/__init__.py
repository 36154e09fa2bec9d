"""Services: the one place each state change of the queue store is made.

The SMTP handler, the workers, the UI, the API and the management commands
all call these functions; none of them changes queue state by itself.
"""
