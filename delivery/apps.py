from django.apps import AppConfig


class DeliveryConfig(AppConfig):
    name = "delivery"
    verbose_name = "Delivery engine"

    def ready(self) -> None:
        # Workers run no system checks: a bad transport map must stop start-up
        # here, not turn every message into a categorizer crash.
        from delivery.checks import validate_routing_settings

        validate_routing_settings()

        from delivery.smtp.retry import validate_retry_settings

        validate_retry_settings()

        # The doorbells: every stage (and the operator surface) says there is
        # work by the store's work signals; the tasks module sends the task.
        from delivery.qmgr import tasks
        from queues.signals import categorizer_work, link_work

        categorizer_work.connect(tasks.ring_categorizer, dispatch_uid="delivery.tasks.categorizer")
        link_work.connect(tasks.ring_link, dispatch_uid="delivery.tasks.link")

        # An operator's re-route is resolved by the engine's router (the store
        # names the port, the engine plugs in: imports point down).
        from delivery.route.routing import resolve_override
        from queues.services import reroute

        reroute.route_resolver = resolve_override
