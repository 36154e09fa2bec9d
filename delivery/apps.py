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

        from queues.signals import categorizer_work, link_work

        categorizer_work.connect(_ring_categorizer, dispatch_uid="delivery.qmgr.bell.categorizer")
        link_work.connect(_ring_link, dispatch_uid="delivery.qmgr.bell.link")

        # An operator's re-route is resolved by the engine's router (the store
        # names the port, the engine plugs in: imports point down).
        from delivery.route.routing import resolve_override
        from queues.services import reroute

        reroute.route_resolver = resolve_override


def _ring_categorizer(sender: object, **kwargs: object) -> None:
    from delivery.qmgr import bell

    bell.ring_categorizer()


def _ring_link(sender: object, link_id: int, **kwargs: object) -> None:
    from delivery.qmgr import bell

    bell.ring_link(link_id)
