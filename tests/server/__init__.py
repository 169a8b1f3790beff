"""Tests of the HTTP server against real `pagedserve serve` processes."""
