"""Shared test fixtures (see module docstring when filled in)."""
