"""Deployable services: thin apps over kubesgl libs."""
