"""The queue manager: the Celery tasks, the categorizer, the sweep, claims."""
