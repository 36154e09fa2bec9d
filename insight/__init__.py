"""Operator insight: why a recipient waits (explain), deferrals across queues
(incidents), alerts on the age of the oldest waiting mail, and a queue's own
live page. Read-only over the queue store, except the alert state it keeps."""
