"""Routers in front of several pagedserve instances."""
