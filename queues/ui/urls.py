"""Queue Viewer pages (filled in by the Queue Viewer work)."""

urlpatterns: list = []
