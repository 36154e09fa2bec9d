from django.apps import AppConfig


class DeliveryConfig(AppConfig):
    name = "delivery"
    verbose_name = "Delivery engine"

    def ready(self) -> None:
        # Workers run no system checks: a bad transport map must stop start-up
        # here, not turn every message into a categorizer crash.
        from delivery.routing import validate_routing_settings

        validate_routing_settings()
