"""Measurements behind `tokenpace bench ...`."""
