"""Helpers shared by the tests (`from support.<module> import ...`)."""
