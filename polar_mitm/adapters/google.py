"""Placeholder: being written."""
STYLE = "google"
