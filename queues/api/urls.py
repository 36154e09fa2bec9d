"""REST API v1 routes (filled in by the Queue Viewer work)."""

urlpatterns: list = []
